"""Key knockout (models/attention/knockout.py): a knocked-out token reaches no other token, on every
backend, in full and sparse layers, and in the whole decoder.

Legend: B batch, H query heads, K kv heads, S tokens, D head dim.
"""

from __future__ import annotations

import pytest
import torch

from mmtrain.models.attention import AttentionConfig, attend, build_meta, recompute_probs, resolve_backend
from mmtrain.models.attention.testing import backends_on, pack_row, random_batch, random_doc_spans, random_qkv
from mmtrain.models.decoder import Decoder, DecoderConfig

B, H, K, S, D, BS = 2, 4, 2, 48, 16, 4


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    """A long document (its sparse layers pick among many earlier blocks) and a packed row."""
    long_S, lspan_S = pack_row([random_doc_spans(S, BS)], S)
    doc_BS, span_BS = random_batch(1, S, BS)
    return torch.stack([long_S, doc_BS[0]]), torch.stack([lspan_S, span_BS[0]])


def _knocked(doc_BS: torch.Tensor) -> torch.Tensor:
    """A random quarter of the real tokens (never the whole row)."""
    return (torch.rand(doc_BS.shape) < 0.25) & (doc_BS >= 0)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("backend", backends_on("cpu"))
def test_knocked_out_keys_reach_no_other_token(backend, sparse):
    """Perturb what knocked-out tokens hold (keys and values): every other row's output is bitwise the
    same, and the recomputed probabilities on those keys are exactly zero."""
    doc_BS, span_BS = _rows()
    knock_BS = _knocked(doc_BS)
    cfg = AttentionConfig(backend=backend, block_size=BS, window=BS, top_k=1, visual_always=False)
    meta = build_meta(doc_BS, span_BS, BS, knockout_BS=knock_BS)
    q, k, v = random_qkv(B, H, K, S, D, grad=False)
    if backend == "flex":  # compiled flex on CPU is slow to build: the eager kernel is the same call
        pytest.importorskip("torch.nn.attention.flex_attention")
    out = attend(q, k, v, meta, cfg, sparse)
    k2 = torch.where(knock_BS[:, None, :, None], torch.randn_like(k) * 10, k)
    v2 = torch.where(knock_BS[:, None, :, None], torch.randn_like(v) * 10, v)
    meta2 = build_meta(doc_BS, span_BS, BS, knockout_BS=knock_BS)
    out2 = attend(q, k2, v2, meta2, cfg, sparse)
    other_BS = ~knock_BS & (doc_BS >= 0)
    assert torch.equal(out.permute(0, 2, 1, 3)[other_BS], out2.permute(0, 2, 1, 3)[other_BS])
    assert resolve_backend(cfg, q, meta, sparse) in (backend, "dense")
    # without the knockout the same perturbation moves them: the test can fail
    plain = [attend(q, kk, vv, build_meta(doc_BS, span_BS, BS), cfg, sparse) for kk, vv in ((k, v), (k2, v2))]
    assert not torch.equal(plain[0].permute(0, 2, 1, 3)[other_BS], plain[1].permute(0, 2, 1, 3)[other_BS])
    rows_R2 = other_BS.nonzero()
    capture = {"q": q, "k": k}
    p_HRS = recompute_probs(capture, meta, cfg, sparse, rows_R2)
    assert float(p_HRS[:, knock_BS[rows_R2[:, 0]]].abs().max()) == 0.0
    assert torch.allclose(p_HRS.sum(-1), torch.ones(()), atol=1e-5)


def test_decoder_knockout_hides_tokens_from_every_layer():
    """Through the whole decoder (embeddings, MoE-free FFNs, full and sparse layers): changing the
    knocked-out tokens' inputs moves no other position's logits."""
    attn = AttentionConfig(block_size=BS, window=BS, top_k=1, visual_always=False)
    dec = Decoder(DecoderConfig(vocab_size=50, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=48,
                                mrope_sections=(2, 3, 3), layer_layout="FS", attention=attn)).eval()
    doc_BS, span_BS = _rows()
    doc_BS, span_BS = doc_BS[:1], span_BS[:1]
    tok_BS = torch.randint(0, 50, (1, S))
    pos_3BS = torch.arange(S).expand(3, 1, S)
    knock_BS = _knocked(doc_BS)
    tok2_BS = torch.where(knock_BS, torch.randint(0, 50, (1, S)), tok_BS)
    mod_BS = torch.zeros(1, S, dtype=torch.long)
    with torch.no_grad():
        a = dec.logits(dec(tok_BS, pos_3BS, doc_BS, span_BS, mod_BS, knockout_BS=knock_BS).hidden_BSD)
        b = dec.logits(dec(tok2_BS, pos_3BS, doc_BS, span_BS, mod_BS, knockout_BS=knock_BS).hidden_BSD)
    other_S = ~knock_BS[0] & (doc_BS[0] >= 0)
    assert torch.equal(a[0, other_S], b[0, other_S])
    assert not torch.equal(a[0, knock_BS[0]], b[0, knock_BS[0]])


def test_knockout_refuses_a_wrong_shape_and_compiled_or_context_calls():
    doc_BS, span_BS = random_batch(1, 8, BS)
    with pytest.raises(ValueError, match="knockout"):
        build_meta(doc_BS, span_BS, BS, knockout_BS=torch.zeros(1, 7, dtype=torch.bool))
    meta = build_meta(doc_BS, span_BS, BS, knockout_BS=torch.zeros(1, 8, dtype=torch.bool))
    q, k, v = random_qkv(1, 2, 1, 8, 8, grad=False)
    with pytest.raises(ValueError, match="knockout"):
        attend(q, k, v, meta, AttentionConfig(block_size=BS), False, context=object())
