"""Where the loss gets per-token cross-entropy from: the full logits (the reference) or the LM head
applied chunk by chunk (`loss.ce_chunk` > 0: chunked_ce.py, never a (B, S, V) tensor).

    head = FullHead(out.logits_BSV, labels_BS)  or  ChunkedHead(out.hidden_BSD, weight_VD, labels_BS, chunk)
    ce_BS, hit_BS = head.ce(lo, hi)    # rows lo:hi of the forward (labels_BS: all its rows'), with the graph
    lse_BS = head.lse(lo, hi)          # their logsumexp (the z-loss)

The full head computes exactly what terms.token_losses / z_loss always did (bit for bit); the
chunked one equals it within fp32 rounding (tests/mmtrain/test_chunked_ce.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from mmtrain.data_pipelines.batch import IGNORE_INDEX
from mmtrain.objectives.chunked_ce import head_ce
from mmtrain.objectives.terms import token_losses


class FullHead:
    def __init__(self, logits_BSV: torch.Tensor, labels_BS: torch.Tensor):
        self.logits_BSV, self.labels_BS = logits_BSV, labels_BS

    def ce(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits_BSV, labels_BS = self.logits_BSV[lo:hi], self.labels_BS[lo:hi]
        with torch.no_grad():
            hit_BS = (logits_BSV.argmax(-1) == labels_BS) & (labels_BS != IGNORE_INDEX)
        return token_losses(logits_BSV, labels_BS), hit_BS

    def lse(self, lo: int, hi: int) -> torch.Tensor:
        return torch.logsumexp(self.logits_BSV[lo:hi].float(), dim=-1)


class ChunkedHead:
    """One chunked pass over all rows of the forward, on first use; rows are slices of its results
    (slicing the hidden states instead would cost a (B, S, D) zeros tensor per slice in backward)."""

    def __init__(self, hidden_BSD: torch.Tensor, weight_VD: torch.Tensor, labels_BS: torch.Tensor,
                 chunk: int, autocast: Callable = contextlib.nullcontext):
        self.hidden_BSD, self.weight_VD, self.labels_BS = hidden_BSD, weight_VD, labels_BS
        self.chunk, self.autocast = chunk, autocast  # the forward's: the head's matmul in its dtype
        self._out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _all(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._out is None:
            with self.autocast():
                self._out = head_ce(self.hidden_BSD, self.weight_VD, self.labels_BS, self.chunk)
        return self._out

    def ce(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        ce_BS, _, hit_BS = self._all()
        return ce_BS[lo:hi], hit_BS[lo:hi]

    def lse(self, lo: int, hi: int) -> torch.Tensor:
        return self._all()[1][lo:hi]


def head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The LM head's (V, D) weight (the tied embedding without one), as the forward used it.
    FSDP2 keeps the root's parameters gathered after its forward (parallelize.py), so this is the
    unsharded parameter there and its gradient joins the root's reduce-scatter; a DTensor here
    would be a shard, whose full_tensor() backward drops the other ranks' gradients: refused."""
    dec = model.decoder
    weight_VD = (dec.embed if dec.lm_head is None else dec.lm_head).weight
    if hasattr(weight_VD, "full_tensor"):
        raise RuntimeError("loss.ce_chunk: the LM head is a sharded DTensor after the forward "
                           "(the chunked loss needs the root module gathered; set loss.ce_chunk: 0)")
    return weight_VD
