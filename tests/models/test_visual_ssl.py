"""Visual self-supervised term: masked-patch reconstruction in the vision encoder (SimMIM-style).

Legend: N patches, P patch dim, M media, K masked patches.
"""

from __future__ import annotations

import pytest
import torch

from mmtrain.models.attention import AttentionConfig
from mmtrain.models.decoder import DecoderConfig
from mmtrain.models.multimodal import ModelConfig, MultimodalModel
from mmtrain.models.testing import IMAGE, VIDEO, pack, random_doc
from mmtrain.models.vision import VisionConfig, VisionEncoder, make_ssl_mask

CFG = VisionConfig(dim=32, depth=1, n_heads=2, patch_size=4, ssl_head=True)
P = CFG.patch_dim
GRIDS = {"images": [[1, 4, 4], [1, 2, 4]], "video": [[2, 4, 4], [3, 2, 2]]}  # t > 1: tubelets in time


def _encoder(cfg: VisionConfig = CFG) -> VisionEncoder:
    return VisionEncoder(cfg, 16, AttentionConfig(backend="dense", block_size=8))


def _media(grids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    grid_M3 = torch.tensor(grids)
    return torch.randn(int(grid_M3.prod(-1).sum()), P), grid_M3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _per_medium(mask_N: torch.Tensor, grid_M3: torch.Tensor) -> list[int]:
    return [int(m.sum()) for m in mask_N.split(grid_M3.prod(-1).tolist())]


def test_mask_picks_share_of_media_and_ratio_of_patches() -> None:
    grid_M3 = torch.tensor([[1, 4, 4]] * 4)
    mask_N = make_ssl_mask(grid_M3, 0.25, 0.5, _gen(0))
    assert mask_N.shape == (64,) and mask_N.dtype == torch.bool
    assert sorted(_per_medium(mask_N, grid_M3)) == [0, 0, 4, 4]
    assert torch.equal(mask_N, make_ssl_mask(grid_M3, 0.25, 0.5, _gen(0)))  # deterministic
    assert not torch.equal(mask_N, make_ssl_mask(grid_M3, 0.25, 0.5, _gen(1)))
    assert _per_medium(make_ssl_mask(grid_M3, 0.5, 1.0, _gen(2)), grid_M3) == [8] * 4
    assert not make_ssl_mask(grid_M3, 0.5, 0.0, _gen(3)).any()
    assert sum(n > 0 for n in _per_medium(make_ssl_mask(grid_M3, 0.5, 0.01, _gen(4)), grid_M3)) == 1
    video_M3 = torch.tensor([[2, 2, 2], [1, 2, 2]])  # at least one patch per picked medium
    assert _per_medium(make_ssl_mask(video_M3, 0.01, 1.0, _gen(5)), video_M3) == [1, 1]
    assert make_ssl_mask(torch.zeros(0, 3, dtype=torch.long), 0.5, 1.0).shape == (0,)


@pytest.mark.parametrize(("ratio", "share", "field"), [
    (0.0, 0.5, "mask_ratio:"), (1.0, 0.5, "mask_ratio:"),
    (0.5, -0.1, "media_share:"), (0.5, 1.5, "media_share:"),
])
def test_mask_arguments_are_validated(ratio: float, share: float, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make_ssl_mask(torch.tensor([[1, 2, 2]]), ratio, share)


@pytest.mark.parametrize("kind", ["images", "video"])
def test_predictions_do_not_see_the_masked_pixels(kind: str) -> None:
    enc = _encoder().eval()
    patches_NP, grid_M3 = _media(GRIDS[kind])
    mask_N = make_ssl_mask(grid_M3, 0.3, 1.0, _gen(0))
    with torch.no_grad():
        pred_KP = enc.masked_patch_predictions(patches_NP, grid_M3, mask_N)
        other_NP = patches_NP.clone()
        other_NP[mask_N] = torch.randn(int(mask_N.sum()), P)
        torch.testing.assert_close(enc.masked_patch_predictions(other_NP, grid_M3, mask_N), pred_KP,
                                   rtol=0, atol=0)
        # the loss moves only through the target
        loss = enc.masked_patch_loss(other_NP, grid_M3, mask_N)
        torch.testing.assert_close(loss, (pred_KP - other_NP[mask_N]).square().mean())
        visible_NP = patches_NP.clone()
        visible_NP[~mask_N] += 1.0  # the context does matter
        assert not torch.allclose(enc.masked_patch_predictions(visible_NP, grid_M3, mask_N), pred_KP)
    assert pred_KP.shape == (int(mask_N.sum()), P)


def test_second_pass_runs_only_the_masked_media() -> None:
    """An unmasked medium packed alongside changes nothing: media are isolated and it is dropped."""
    enc = _encoder().eval()
    patches_NP, grid_M3 = _media(GRIDS["video"])
    mask_N = make_ssl_mask(grid_M3[:1], 0.4, 1.0, _gen(1))
    mask_N = torch.cat([mask_N, torch.zeros(12, dtype=torch.bool)])  # second medium (3x2x2) unmasked
    with torch.no_grad():
        both = enc.masked_patch_predictions(patches_NP, grid_M3, mask_N)
        alone = enc.masked_patch_predictions(patches_NP[:32], grid_M3[:1], mask_N[:32])
    torch.testing.assert_close(both, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["images", "video"])
def test_loss_decreases_when_training_the_encoder(kind: str) -> None:
    torch.manual_seed(int(torch.randint(0, 2**31, ()).item()))
    enc = _encoder().train()
    patches_NP, grid_M3 = _media(GRIDS[kind])
    mask_N = make_ssl_mask(grid_M3, 0.5, 1.0, _gen(2))
    opt = torch.optim.Adam(enc.parameters(), lr=2e-3)
    losses = []
    for _ in range(30):
        loss = enc.masked_patch_loss(patches_NP, grid_M3, mask_N)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses  # 20 seeds: at most 0.79


@pytest.mark.parametrize("grids", [[[1, 4, 4]], []])
def test_empty_mask_gives_zero_with_zero_gradients(grids: list) -> None:
    enc = _encoder().train()
    patches_NP = torch.randn(16 * len(grids), P)
    grid_M3 = torch.tensor(grids, dtype=torch.long).view(-1, 3)
    loss = enc.masked_patch_loss(patches_NP, grid_M3, torch.zeros(len(patches_NP), dtype=torch.bool))
    assert loss.item() == 0.0
    loss.backward()
    for p in (enc.mask_token, enc.ssl_head.weight, enc.ssl_head.bias):
        assert p.grad is not None and not p.grad.any()
    assert enc.masked_patch_predictions(patches_NP, grid_M3, torch.zeros(len(patches_NP), dtype=torch.bool)
                                        ).shape == (0, P)


def test_bad_ssl_inputs_are_named() -> None:
    patches_NP, grid_M3 = _media(GRIDS["images"])
    mask_N = torch.ones(len(patches_NP), dtype=torch.bool)
    with pytest.raises(ValueError, match="ssl_head:"):
        _encoder(VisionConfig(dim=32, depth=1, n_heads=2, patch_size=4)).masked_patch_loss(
            patches_NP, grid_M3, mask_N)
    enc = _encoder()
    with pytest.raises(ValueError, match="ssl_mask:"):
        enc.masked_patch_loss(patches_NP, grid_M3, mask_N[1:])
    with pytest.raises(ValueError, match="ssl_mask:"):
        enc.masked_patch_loss(patches_NP, grid_M3, mask_N.long())
    with pytest.raises(ValueError, match="grid_thw:"):
        enc.masked_patch_loss(patches_NP[:-1], grid_M3, mask_N[:-1])


def _model_cfg(ssl: bool) -> ModelConfig:
    return ModelConfig(
        VisionConfig(dim=32, depth=1, n_heads=2, patch_size=4, ssl_head=ssl),
        DecoderConfig(vocab_size=100, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=48,
                      mrope_sections=(2, 3, 3), layer_layout="F",
                      attention=AttentionConfig(backend="dense", block_size=8)))


def test_forward_returns_visual_ssl_and_is_otherwise_unchanged() -> None:
    model = MultimodalModel(_model_cfg(True)).train()
    inputs = pack([[random_doc(100, P, 6, ((IMAGE, (1, 4, 4)), (VIDEO, (2, 2, 4))))]], 32, P)
    mask_N = make_ssl_mask(inputs["grid_thw_M3"], 0.5, 1.0, _gen(3))
    plain, ssl = model(**inputs), model(**inputs, ssl_mask_N=mask_N)
    assert plain.visual_ssl is None and ssl.visual_ssl.shape == () and ssl.visual_ssl > 0
    for name in ("logits_BSV", "hidden_BSD", "visual_embeds_ND"):
        torch.testing.assert_close(getattr(ssl, name), getattr(plain, name), rtol=0, atol=0)
    torch.testing.assert_close(ssl.visual_ssl, model.vision.masked_patch_loss(
        inputs["patches_NP"], inputs["grid_thw_M3"], mask_N))
    ssl.visual_ssl.backward()
    assert model.vision.mask_token.grad.any() and model.vision.ssl_head.weight.grad.any()
    assert model.vision.projector.w_in.weight.grad is None  # the merge / projector are not in the SSL pass


def test_ssl_head_off_keeps_the_state_dict_and_counts_the_head_as_vision() -> None:
    off, on = MultimodalModel(_model_cfg(False)), MultimodalModel(_model_cfg(True))
    extra = {"vision.mask_token", "vision.ssl_head.weight", "vision.ssl_head.bias"}
    assert set(on.state_dict()) == set(off.state_dict()) | extra
    assert not any("ssl" in k or "mask_token" in k for k in off.state_dict())
    on.load_state_dict(off.state_dict(), strict=False)  # an old checkpoint still loads
    n_extra = 32 + 32 * P + P
    c_off, c_on = off.num_params(), on.num_params()
    assert (c_on.total - c_off.total, c_on.vision - c_off.vision) == (n_extra, n_extra)
    assert on.flops_per_token(64, 0.5, 16) == off.flops_per_token(64, 0.5, 16)  # SSL pass not counted


def test_meta_device_build_then_init_weights() -> None:
    with torch.device("meta"):
        model = MultimodalModel(_model_cfg(True))
    model.to_empty(device="cpu")
    model.init_weights()
    assert all(torch.isfinite(t).all() for t in model.state_dict().values())
    assert not model.vision.ssl_head.bias.any() and model.vision.mask_token.std() > 0
