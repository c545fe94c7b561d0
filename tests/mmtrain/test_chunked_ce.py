"""The chunked LM head + cross-entropy (objectives/chunked_ce.py) against the full-logits reference
on fresh random inputs: per-token CE, logsumexp, hits and the gradients wrt the hidden states and
the head, whatever the chunk; its peak memory scales with the chunk, not with the sequence.

Legend: B rows, S tokens, D width, V vocabulary, T = B * S.
"""

from __future__ import annotations

import pytest
import torch

from mmtrain.data_pipelines.batch import IGNORE_INDEX
from mmtrain.objectives.chunked_ce import full_logits_ce, head_ce
from mmtrain.objectives.heads import ChunkedHead, FullHead
from tools.bench.bench_loss_memory import peak_bytes


def _inputs(seed: int, B=2, S=53, D=24, V=97, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden_BSD = torch.randn(B, S, D, generator=gen).to(dtype).requires_grad_()
    weight_VD = (torch.randn(V, D, generator=gen) / D**0.5).to(dtype).requires_grad_()
    labels_BS = torch.randint(0, V, (B, S), generator=gen)
    labels_BS[torch.rand(B, S, generator=gen) < 0.3] = IGNORE_INDEX
    g_ce_BS, g_lse_BS = torch.randn(B, S, generator=gen), torch.randn(B, S, generator=gen)
    return hidden_BSD, weight_VD, labels_BS, g_ce_BS, g_lse_BS


def _run(fn, hidden_BSD, weight_VD, g_ce_BS, g_lse_BS):
    """-> ce, lse, hit and the gradients of sum(g_ce * ce + g_lse * lse^2) (as the z-loss reads lse)."""
    hidden_BSD.grad = weight_VD.grad = None
    ce_BS, lse_BS, hit_BS = fn()
    ((g_ce_BS * ce_BS).sum() + (g_lse_BS * lse_BS.square()).sum()).backward()
    return ce_BS.detach(), lse_BS.detach(), hit_BS, hidden_BSD.grad, weight_VD.grad


@pytest.mark.parametrize("chunk", [1, 16, 106, 500])  # T = 106: one chunk, and one bigger than T
@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_equals_the_full_logits_reference(chunk, seed):
    h, w, labels_BS, g_ce, g_lse = _inputs(seed)
    got = _run(lambda: head_ce(h, w, labels_BS, chunk), h, w, g_ce, g_lse)
    want = _run(lambda: full_logits_ce(torch.nn.functional.linear(h, w), labels_BS), h, w, g_ce, g_lse)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    assert (got[0][labels_BS == IGNORE_INDEX] == 0).all() and got[2].any()


def test_under_bf16_autocast_the_matmul_runs_in_bf16_as_the_reference():
    h, w, labels_BS, g_ce, g_lse = _inputs(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run(lambda: head_ce(h, w, labels_BS, 16), h, w, g_ce, g_lse)
        want = _run(lambda: full_logits_ce(torch.nn.functional.linear(h, w), labels_BS), h, w, g_ce, g_lse)
    fp32 = _run(lambda: head_ce(h, w, labels_BS, 16), h, w, g_ce, g_lse)
    assert got[3].dtype == torch.float32  # the leaf's gradient, through autocast's cast
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)  # the same bf16 logits
    assert not torch.equal(got[1], fp32[1])
    for g, r in zip(got[3:], want[3:]):
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2)


def test_the_chunked_head_forms_its_logits_in_the_autocast_it_is_given():
    """The objective calls the head after the forward, outside its autocast: ChunkedHead takes it
    along, so that fp32 hidden states (the final norm's) meet the head in bf16 as in the forward."""
    h, w, labels_BS, _, _ = _inputs(3, D=64)
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    with bf16():
        ref_BS = FullHead(torch.nn.functional.linear(h, w), labels_BS).ce(0, 2)[0]
    got_BS = ChunkedHead(h, w, labels_BS, 16, bf16).ce(0, 2)[0]
    fp32_BS = ChunkedHead(h, w, labels_BS, 16).ce(0, 2)[0]
    torch.testing.assert_close(got_BS, ref_BS, rtol=0, atol=1e-5)
    assert (fp32_BS - ref_BS).abs().max() > 1e-3


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("S", [512, 4096])
def test_peak_memory_scales_with_the_chunk_not_with_the_sequence(S, autocast):
    """MemTracker over fake tensors (tools/bench/bench_loss_memory.py): the chunked loss's forward +
    backward peak, above its inputs, is one chunk's logits and a half (two under bf16, with its
    bf16 copies of the head), the two gradients and some per-token vectors; the reference's is
    several full (T, V) copies."""
    D, V, chunk = 32, 1024, 64
    T = S
    bound = (2 if autocast else 1.5) * chunk * V * 4 + 4 * T * D + (8 if autocast else 4) * V * D + 64 * T
    assert peak_bytes(1, S, D, V, chunk, autocast) <= bound
    assert peak_bytes(1, S, D, V, 0, autocast) >= 3 * T * V * 4
