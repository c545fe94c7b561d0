"""The whole model on tiny packed batches: gradients everywhere, packing isolation, tied
embeddings, MoE bias updates, meta-device init, and hand-checked parameter / FLOP counts.

Legend: B rows, S tokens, V vocab, D decoder dim, N patches, P patch dim.
"""

from __future__ import annotations

import pytest
import torch

from mmtrain.models.attention import AttentionConfig
from mmtrain.models.decoder import DecoderConfig
from mmtrain.models.moe import MoEConfig
from mmtrain.models.multimodal import ModelConfig, MultimodalModel
from mmtrain.models.testing import IMAGE, VIDEO, pack, random_doc
from mmtrain.models.vision import VisionConfig

V = 100


def _cfg(backend: str = "auto", layout: str = "FS", moe: bool = True, tie: bool = False,
         groups: bool = True) -> ModelConfig:
    moe_cfg = MoEConfig(n_routed=4, top_k=2, n_shared=1, expert_dim=16, modality_groups=groups,
                        n_text_experts=2 if groups else 0, n_visual_experts=2 if groups else 0)
    return ModelConfig(
        VisionConfig(dim=32, depth=1, n_heads=2, patch_size=4),
        DecoderConfig(vocab_size=V, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96,
                      mrope_sections=(2, 3, 3), tie_embeddings=tie, layer_layout=layout,
                      attention=AttentionConfig(backend=backend, block_size=8, window=16, top_k=1),
                      moe=moe_cfg if moe else None))


P = _cfg().vision.patch_dim


def _batch() -> dict[str, torch.Tensor]:
    rows = [[random_doc(V, P, 9, ((IMAGE, (1, 4, 6)),)), random_doc(V, P, 7)],
            [random_doc(V, P, 5, ((VIDEO, (2, 4, 4)), (IMAGE, (1, 2, 2)))), random_doc(V, P, 4)]]
    return pack(rows, 64, P)


def _loss(out) -> torch.Tensor:
    return out.logits_BSV.float().logsumexp(-1).mean() + sum(out.aux_losses.values())


def test_forward_backward_reaches_every_parameter() -> None:
    model = MultimodalModel(_cfg()).train()
    inputs = _batch()
    out = model(**inputs, capture_layers=[0, 1])
    assert out.logits_BSV.shape == (2, 64, V)
    assert out.visual_embeds_ND.shape == (inputs["patches_NP"].shape[0] // 4, 64)
    assert set(out.aux_losses) == {"moe_seq_balance", "router_z"}
    assert set(out.expert_load) == {1, 2} and set(out.captures) == {0, 1}
    assert "selection" in out.captures[1] and out.captures[0]["q"].shape == (2, 4, 64, 16)
    n_visual, n_real = int((inputs["modality_BS"] != 0).sum()), int((inputs["doc_ids_BS"] >= 0).sum())
    assert n_real < 2 * 64  # the batch has padding, which is not routed
    for load_3E in out.expert_load.values():
        assert load_3E.sum() == n_real * 2 and load_3E[1:].sum() == n_visual * 2
    loss = _loss(out)
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if not name.endswith("w_in_EDF2") and not name.endswith("w_out_EFD"):  # an expert may idle
            assert p.grad.any(), name


def test_packed_document_gives_the_same_logits_as_alone() -> None:
    model = MultimodalModel(_cfg(backend="dense", layout="F")).eval()
    doc_a = random_doc(V, P, 6, ((IMAGE, (1, 4, 4)), (VIDEO, (2, 2, 4))))
    doc_b = random_doc(V, P, 10, ((VIDEO, (2, 4, 2)),))
    n_a = sum(s.numel() if isinstance(s, torch.Tensor) else s.grid_thw[0] * s.grid_thw[1] * s.grid_thw[2] // 4
              for s in doc_a)
    alone = pack([[doc_a]], 48, P)
    packed = pack([[doc_b, doc_a]], 48, P)
    start = int((packed["doc_ids_BS"][0] == 0).sum())
    with torch.no_grad():
        l_alone = model(**alone).logits_BSV[0, :n_a]
        l_packed = model(**packed).logits_BSV[0, start:start + n_a]
    torch.testing.assert_close(l_packed, l_alone, atol=1e-4, rtol=1e-4)


def test_text_only_batch_and_hidden_without_logits() -> None:
    model = MultimodalModel(_cfg())
    inputs = pack([[random_doc(V, P, 20), random_doc(V, P, 12)]], 40, P)
    out = model(**inputs, compute_logits=False)
    assert out.logits_BSV is None and out.visual_embeds_ND.shape == (0, 64)
    torch.testing.assert_close(model.logits(out.hidden_BSD), model(**inputs).logits_BSV)
    out.hidden_BSD.square().mean().backward()
    assert all(p.grad is not None for p in model.vision.parameters())  # FSDP2: same collectives


def test_tied_embeddings() -> None:
    tied, untied = MultimodalModel(_cfg(tie=True)), MultimodalModel(_cfg(tie=False))
    assert tied.decoder.lm_head is None
    assert tied.num_params().total == untied.num_params().total - V * 64
    out = tied(**_batch())
    _loss(out).backward()
    assert tied.decoder.embed.weight.grad.abs().sum() > 0
    torch.testing.assert_close(out.logits_BSV, out.hidden_BSD @ tied.decoder.embed.weight.t())


def test_moe_bias_update_uses_the_reduced_load() -> None:
    model = MultimodalModel(_cfg(groups=False)).train()
    inputs = _batch()
    model(**inputs)
    moe = model.moe_layers()[1]
    assert moe.load_E.sum() == 2 * int((inputs["doc_ids_BS"] >= 0).sum())  # real tokens, top-2

    def fake_all_reduce(load_LE: torch.Tensor) -> None:  # what the other ranks would add
        assert load_LE.shape == (2, 4)
        load_LE.copy_(torch.tensor([10, 0, 0, 0]).expand(2, 4))

    model.update_moe_bias(reduce_fn=fake_all_reduce)
    assert moe.load_E.sum() == 0
    rate = moe.cfg.bias_update_rate
    torch.testing.assert_close(moe.router.expert_bias_E, torch.tensor([-rate, rate, rate, rate]))
    model.eval()
    with torch.no_grad():
        model(**_batch())
    assert moe.load_E.sum() == 0  # evaluation forwards do not count


def test_meta_device_build_then_init_weights() -> None:
    with torch.device("meta"):
        model = MultimodalModel(_cfg())
    model.to_empty(device="cpu")
    model.init_weights()
    assert all(torch.isfinite(t).all() for t in model.state_dict().values())
    assert torch.isfinite(model(**_batch()).logits_BSV).all()


def _hand_count(cfg: ModelConfig) -> tuple[int, int, int]:
    """(total, active, decoder matmul params used per token) written out from the architecture."""
    vc, dc, mc = cfg.vision, cfg.decoder, cfg.decoder.moe
    d, vd, hd = dc.dim, vc.dim, dc.head_dim
    vit_block = 2 * vd + vd * 3 * vd + vd * vd + 2 * (vd // vc.n_heads) + 2 * vd * 4 * vd
    vision = vc.patch_dim * vd + vd + vc.depth * vit_block + vd + 4 * vd * 4 * vd + 4 * vd * d
    attn = d * (dc.n_heads + 2 * dc.n_kv_heads) * hd + dc.n_heads * hd * d
    layer = 2 * d + attn + 2 * hd
    dense_ffn = 3 * d * dc.ffn_dim
    expert = 3 * d * mc.expert_dim
    moe = d * mc.n_routed + mc.n_routed * expert + mc.n_shared * expert
    total = vision + V * d + 3 * layer + dense_ffn + 2 * moe + d + V * d
    active = total - 2 * (mc.n_routed - mc.top_k) * expert
    matmul = 3 * attn + dense_ffn + 2 * (moe - (mc.n_routed - mc.top_k) * expert) + V * d
    return total, active, matmul


def test_param_and_flop_counts_match_a_hand_count() -> None:
    cfg = _cfg(groups=False)
    model = MultimodalModel(cfg)
    total, active, matmul = _hand_count(cfg)
    counts = model.num_params()
    assert (counts.total, counts.active) == (total, active)
    S, hd, H = 256, 16, 4
    keys = [S / 2, (1 + 16 / 8 + 1 + 1) * 8, S / 2]  # layout "FS" over 3 layers
    text = 6 * matmul + sum(12 * H * hd * k for k in keys)
    assert model.flops_per_token(S) == pytest.approx(text)
    vc = cfg.vision
    vd = vc.dim
    vit_matmul = vc.patch_dim * vd + vc.depth * (3 * vd * vd + vd * vd + 8 * vd * vd)
    per_patch = 6 * vit_matmul + 12 * vd * 16 * vc.depth  # 16 patches per medium
    per_visual = 4 * per_patch + 6 * (4 * vd * 4 * vd + 4 * vd * 64)  # merge^2 patches + projector
    assert model.flops_per_token(S, 0.5, 16) == pytest.approx(text + 0.5 * per_visual, rel=1e-3)


def test_vision_out_norm_counts_as_vision_parameters_not_flops() -> None:
    cfg = _cfg(groups=False)
    plain = MultimodalModel(cfg)
    cfg.vision.out_norm = True
    normed = MultimodalModel(cfg)
    a, b, D = plain.num_params(), normed.num_params(), cfg.decoder.dim
    assert (b.total - a.total, b.active - a.active, b.vision - a.vision) == (D, D, D)
    assert normed.flops_per_token(256, 0.5, 16) == plain.flops_per_token(256, 0.5, 16)


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(vocab_size=0), "vocab_size:"), (dict(layer_layout="FX"), "layer_layout:"),
    (dict(n_kv_heads=3), "n_kv_heads:"), (dict(mrope_sections=(4, 4, 4)), "mrope_sections:"),
])
def test_decoder_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DecoderConfig(**{"vocab_size": V, **kwargs})


def test_vocab_must_be_filled_before_building() -> None:
    cfg = _cfg()
    cfg.decoder.vocab_size = None
    with pytest.raises(ValueError, match="vocab_size:"):
        MultimodalModel(cfg)
