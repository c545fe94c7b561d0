"""FFN / MoE in chunks of tokens (models/chunked.py): the same outputs and gradients as all at once."""

from __future__ import annotations

import pytest
import torch

from mmtrain.models.chunked import over_tokens
from mmtrain.models.decoder import DecoderConfig, DecoderLayer
from mmtrain.models.moe import MoEConfig


def _layer(chunk: int, moe: bool) -> DecoderLayer:
    torch.manual_seed(0)
    moe_cfg = MoEConfig(n_routed=4, top_k=2, n_shared=1, expert_dim=16, first_dense_layers=0) if moe else None
    cfg = DecoderConfig(vocab_size=32, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=48, mrope_sections=(2, 3, 3),
                        moe=moe_cfg, ffn_chunk=chunk)
    return DecoderLayer(cfg, 0)


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_ffn_equals_whole(moe, chunk):
    whole, chunked = _layer(0, moe), _layer(chunk, moe)
    torch.manual_seed(1)
    x_BSD = torch.randn(2, 37, 32)
    modality_BS = torch.randint(0, 3, (2, 37))
    real_BS = torch.rand(2, 37) > 0.2  # padding: routed nowhere, in every chunk
    outs = []
    for layer in (whole, chunked):
        x = x_BSD.clone().requires_grad_()
        y, aux = layer.feed_forward(x, modality_BS, real_BS)
        (y.square().sum() + sum(v for k, v in aux.items() if v.requires_grad)).backward()
        outs.append((y, aux, x.grad, [p.grad for p in layer.parameters()]))
    (y0, aux0, gx0, gp0), (y1, aux1, gx1, gp1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
    for a, b in zip(gp1, gp0):  # sums over tokens in another order: fp32 rounding
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert aux1.keys() == aux0.keys()
    for k in aux0:
        torch.testing.assert_close(aux1[k], aux0[k], rtol=1e-5, atol=1e-6)


def test_over_tokens_checkpoints_each_chunk():
    """With grad, only the chunk outputs are kept: the function runs again per chunk in backward."""
    calls = []

    def fn(x_TD):
        calls.append(x_TD.shape[0])
        return x_TD.sin() * 2

    x = torch.randn(10, 3, requires_grad=True)
    y = over_tokens(fn, 4, x)
    assert calls == [4, 4, 2]
    y.sum().backward()
    assert sorted(calls[3:]) == [2, 4, 4]  # recomputed in backward
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())
    with torch.no_grad():
        assert torch.equal(over_tokens(fn, 4, x), fn(x))


def test_a_fixed_chunk_count_runs_empty_chunks_in_forward_and_in_the_recompute():
    """n_chunks beyond what T needs (a collective dispatch agreed with ranks holding more tokens):
    fn runs exactly n_chunks times in forward and again in backward's recompute, same result."""
    calls = []

    def fn(x_TD):
        calls.append(x_TD.shape[0])
        return x_TD.sin() * 2

    x_TD = torch.randn(10, 3, requires_grad=True)
    y_TD = over_tokens(fn, 4, x_TD, n_chunks=5)  # 3 chunks hold the tokens, 2 are empty
    assert calls == [4, 4, 2, 0, 0]
    y_TD.sum().backward()
    assert sorted(calls[5:]) == [0, 0, 2, 4, 4]  # every chunk recomputed, the empty ones too
    torch.testing.assert_close(y_TD, x_TD.sin() * 2)
    torch.testing.assert_close(x_TD.grad, x_TD.detach().cos() * 2)
