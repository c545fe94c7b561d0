"""The KV cache of one generation batch: one row per prompt, one document per row.

Row b's document occupies positions [0, len_b) of its row (doc-relative = row-relative), so its
blocks are the row's blocks [n * Bs, (n + 1) * Bs). Every layer keeps K and V after QK-norm and
rotary in a preallocated (B, K, C, E) buffer (gpt-fast's layout: written in place at each row's
position, never concatenated). Sparse layers also keep what their selection reads:
  * kmean: fp32 mean key of every block, the own block's refreshed at every step, so the mean of
    a block is final when the block completes (only completed blocks are ever scored);
  * vis: whether a block holds a visual token (visual_always);
  * select == "block": the selection heads' queries of the current block (qcur), the mean query of
    the previous block (qprev), and the keys the current block keeps (constant inside a block, so
    rebuilt only when a row enters a new block).
Slots past a row's length hold zeros (so a partial block's mean is the sum of its tokens / Bs
until it completes, when it is exactly the training forward's block mean).

Legend: B rows, K kv heads, G selection heads, C capacity (positions, whole blocks), N = C / Bs
blocks, E head dim, Bs block size, T listed blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

Tensor = torch.Tensor


@dataclass
class LayerCache:
    k_BKCE: Tensor
    v_BKCE: Tensor
    sparse: bool = False
    kmean_BKNE: Tensor | None = None  # fp32 (sparse layers)
    vis_BN: Tensor | None = None  # bool (sparse layers)
    qcur_BGbE: Tensor | None = None  # fp32 selection queries of the current block (select == "block")
    qprev_BGE: Tensor | None = None  # fp32 mean query of the previous block (select == "block")
    kept: Any = field(default=None, repr=False)  # select == "block": the current block's KeptKeys

    def per_position(self) -> list[Tensor]:
        """The tensors that grow with the capacity (bytes per token = their bytes / C)."""
        return [t for t in (self.k_BKCE, self.v_BKCE, self.kmean_BKNE, self.vis_BN) if t is not None]


@dataclass
class KVCache:
    layers: list[LayerCache]
    len_B: Tensor  # int64 tokens of each row so far (= the position of the next token)
    pos_B: Tensor  # int64 M-RoPE position of the next token (t = h = w: generated tokens are text)
    block_size: int

    @property
    def capacity(self) -> int:
        return self.layers[0].k_BKCE.shape[2]

    @property
    def batch(self) -> int:
        return self.len_B.shape[0]

    def bytes_per_token(self) -> float:
        """Bytes the cache holds per position, all layers (K, V; block means and flags of sparse layers)."""
        total = sum(t.numel() * t.element_size() for lc in self.layers for t in lc.per_position())
        return total / (self.capacity * self.batch)

    def nbytes(self) -> int:
        fields_ = ("k_BKCE", "v_BKCE", "kmean_BKNE", "vis_BN", "qcur_BGbE", "qprev_BGE")
        return sum(t.numel() * t.element_size() for lc in self.layers for f in fields_
                   if (t := getattr(lc, f)) is not None)


def round_capacity(n: int, block_size: int) -> int:
    return max(1, -(-n // block_size)) * block_size


def new_layer(B: int, K: int, C: int, E: int, dtype: torch.dtype, device, sparse: bool, G: int,
              block_size: int, block_select: bool) -> LayerCache:
    lc = LayerCache(torch.zeros(B, K, C, E, dtype=dtype, device=device),
                    torch.zeros(B, K, C, E, dtype=dtype, device=device), sparse)
    if sparse:
        N = C // block_size
        lc.kmean_BKNE = torch.zeros(B, K, N, E, dtype=torch.float32, device=device)
        lc.vis_BN = torch.zeros(B, N, dtype=torch.bool, device=device)
        if block_select:
            lc.qcur_BGbE = torch.zeros(B, G, block_size, E, dtype=torch.float32, device=device)
            lc.qprev_BGE = torch.zeros(B, G, E, dtype=torch.float32, device=device)
    return lc


def block_of(x_BKCE: Tensor, n_B: Tensor, block_size: int) -> Tensor:
    """(B, K, Bs, E): block n_b of every row b."""
    B, K, C, E = x_BKCE.shape
    blocks_BKNbE = x_BKCE.view(B, K, C // block_size, block_size, E)
    idx = n_B.view(B, 1, 1, 1, 1).expand(B, K, 1, block_size, E)
    return blocks_BKNbE.gather(2, idx)[:, :, 0]


def refresh_kmean(lc: LayerCache, n_B: Tensor, block_size: int) -> None:
    """kmean of block n_b of every row from the K buffer (zeros past the row's length)."""
    B, K, _, E = lc.kmean_BKNE.shape
    mean_BKE = block_of(lc.k_BKCE, n_B, block_size).float().sum(-2) / block_size
    lc.kmean_BKNE.scatter_(2, n_B.view(B, 1, 1, 1).expand(B, K, 1, E), mean_BKE[:, :, None])
