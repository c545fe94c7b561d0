"""Per-forward attention metadata: the token rule, document-relative blocks, the aligned layout.

The token rule (every layer, every backend computes exactly this): query i may attend key j iff
    doc[i] == doc[j]  and  (j <= i  or  skey[i] == skey[j]),
where skey is one id per visual span (an image, or one video frame: bidirectional inside) and
unique for every other token. Blocks are counted from each document's first token: block n of a
document is its tokens [n * Bs, (n + 1) * Bs) (ranks within the document), so a document gives
the same result alone or packed at any offset. Documents need not be contiguous runs.

Sparse layers run on the *aligned layout* (`AlignedLayout`, built lazily once per forward): the
row's documents one after the other, each starting on a multiple of Bs, so every aligned block
is exactly one document block (a document wastes < Bs slots; empty slots hold no token).
Everything is O(S) per row (no Q x Q table), so metadata stays small at 1M tokens.

Its length A is bounded so that compiled code (flex's kernel, its BlockMask) sees few shapes: a
document of n tokens takes ceil(n / Bs) blocks and ceil(a) + ceil(b) <= ceil(a + b) + 1, so a
row of D documents (a padding run counts as one) needs A <= Q + D - 1 blocks, and A <= S (no
block is empty). With a per-row document cap (`max_docs`) A is static, min(S, Q + max_docs - 1),
and nothing is read on the host (an async assert guards the cap); without one the longest row's
need is read once per forward and A = Q + its excess over Q rounded up to a power of two (capped
at S): `aligned_sizes` lists the at most ceil(log2(S - Q)) + 2 values. Empty trailing blocks
change nothing computed (they hold no token; every backend already pads shorter rows so).

Host reads left (each once per forward, cached in `AttnMeta.cache`; none under `max_docs` for A):
  aligned_blocks  without a document cap: the bucket of the longest row's need (one int);
  has_spans       flash only (it cannot do bidirectional spans; a CUDA eager choice);
  docs_contiguous sdpa's and flash's `usable` (the backend choice is a host decision); flex reads
                  the tensor form (`contiguous`) instead.

Legend: B batch rows, S tokens, P = Q * Bs row tokens padded to whole blocks, Q row blocks,
A aligned blocks, L = A * Bs aligned slots, Bs block size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
NO_SPAN = 2**40  # closure range of a text token: [NO_SPAN, -1] is empty


def token_mask(doc_q: Tensor, skey_q: Tensor, pos_q: Tensor, doc_k: Tensor, skey_k: Tensor,
               pos_k: Tensor) -> Tensor:
    """The token rule, broadcasting over any shapes (skey from `AttnMeta`)."""
    return (doc_q == doc_k) & ((pos_k <= pos_q) | (skey_q == skey_k))


@dataclass
class AlignedLayout:
    """The sparse layers' layout: every document starts an aligned block (see the module doc)."""

    block_size: int  # Bs
    aligned_blocks: int  # A
    slot_BS: Tensor  # int64 aligned slot of every token
    src_BL: Tensor  # int64 row position of every slot, -1 for an empty slot
    doc_BL: Tensor  # int64 document of every slot, `null` for an empty one
    skey_BL: Tensor  # int64 span key of every slot (unique for empty slots)
    span_lo_BL: Tensor  # int64 doc-relative closure range of the slot's span (text: empty range)
    span_hi_BL: Tensor
    first_BA: Tensor  # int64 aligned index of the block's document block 0 (itself when empty)
    vis_BA: Tensor  # bool: the block holds a visual token
    count_BA: Tensor  # float32 tokens in the block
    real_BA: Tensor  # bool: the block holds a token of a real (non-padding) document

    @property
    def num_slots(self) -> int:
        return self.aligned_blocks * self.block_size


@dataclass
class AttnMeta:
    block_size: int  # Bs
    seq_len: int  # S (unpadded)
    doc_BS: Tensor  # int64 document id; ids < 0 mark padding (its own document: not counted)
    skey_BS: Tensor  # int64 span key: >= 0 the span's first position for visual tokens, else -(pos+1)
    rank_BS: Tensor  # int64 position of the token within its document
    first_BS: Tensor  # int64 row position of the document's first token
    span_last_BS: Tensor  # int64 row position of the last token of the token's span (text: itself)
    span_lo_BS: Tensor  # int64 doc-relative block range of the token's span (text: NO_SPAN, -1)
    span_hi_BS: Tensor
    ablk_BS: Tensor  # int64 aligned block of the token
    base_BS: Tensor  # int64 aligned block of the token's document block 0
    vis_BS: Tensor  # bool: visual token
    blocks_B: Tensor  # int64 aligned blocks each row needs
    null: Tensor  # int64 scalar: a document id no token has (empty slots, padded blocks)
    max_docs: int = 0  # per-row document cap: A static (0: A bucketed from the longest row's need)
    # Key knockout (analysis, e.g. the attention-map tool's faithfulness): True = the token is
    # invisible to every other token (knockout.py); None: no knockout.
    knock_BS: Tensor | None = None
    # Per-forward cache of what layers share (aligned layout, gather intervals, flex BlockMasks,
    # the host values below).
    cache: dict = field(default_factory=dict, repr=False)

    # Host values, computed on first use (a host sync each; build_meta itself never syncs).
    @property
    def has_spans(self) -> bool:
        """Any visual token in the batch (flash cannot do bidirectional spans)."""
        return self._host("has_spans", lambda: bool(self.vis_BS.any()))

    @property
    def contiguous(self) -> Tensor:
        """bool scalar tensor: every document is one run of tokens (no host sync)."""
        if "contiguous" not in self.cache:
            run_start_BS = F.pad(self.doc_BS[:, 1:] != self.doc_BS[:, :-1], (1, 0), value=True)
            pos_BS = torch.arange(self.seq_len, device=self.doc_BS.device).expand_as(self.doc_BS)
            self.cache["contiguous"] = (run_start_BS == (self.first_BS == pos_BS)).all()
        return self.cache["contiguous"]

    @property
    def docs_contiguous(self) -> bool:
        """Every document is one run of tokens (flash's cu_seqlens need it)."""
        return self._host("docs_contiguous", lambda: bool(self.contiguous))

    @property
    def aligned_blocks(self) -> int:
        """A: aligned blocks per row, bounded (see the module docstring): static under `max_docs`,
        else the longest row's need bucketed (one host read)."""
        S, Bs = self.seq_len, self.block_size
        if self.max_docs:
            return static_blocks(S, Bs, self.max_docs)
        need = lambda: int(self.blocks_B.max()) if S else 1  # noqa: E731
        return self._host("aligned_blocks", lambda: bucket_blocks(need(), S, Bs))

    def _host(self, name: str, fn):
        if name not in self.cache:
            self.cache[name] = fn()
        return self.cache[name]

    @property
    def batch(self) -> int:
        return self.doc_BS.shape[0]

    @property
    def row_blocks(self) -> int:
        """Q: row blocks (the full layers' tiles)."""
        return -(-self.seq_len // self.block_size)

    @property
    def nblk_BS(self) -> Tensor:
        """Doc-relative block of every token."""
        return self.rank_BS // self.block_size

    @property
    def real_BS(self) -> Tensor:
        return self.doc_BS >= 0

    def padded(self, name: str, tile: int) -> Tensor:
        """doc or skey padded to whole tiles of `tile` tokens: padding gets `null` / unique keys."""
        S = self.seq_len
        P = -(-S // tile) * tile
        if name == "doc":
            return torch.cat([self.doc_BS, self.null.expand(self.batch, P - S)], 1)
        pad = -torch.arange(S + 1, P + 1, device=self.doc_BS.device)
        return torch.cat([self.skey_BS, pad.expand(self.batch, P - S)], 1)

    def aligned(self) -> AlignedLayout:
        if "aligned" not in self.cache:
            self.cache["aligned"] = _aligned(self)
        return self.cache["aligned"]


def static_blocks(S: int, Bs: int, max_docs: int) -> int:
    """A for rows of S tokens holding at most `max_docs` documents (module docstring)."""
    return max(min(S, -(-S // Bs) + max_docs - 1), 1)


def bucket_blocks(need: int, S: int, Bs: int) -> int:
    """A for a batch whose longest row needs `need` blocks: Q + the excess rounded up to a power of
    two, capped at S (the most any row can need)."""
    Q = -(-S // Bs)
    excess = max(need - Q, 0)
    return max(min(S, Q + (1 << (excess - 1).bit_length() if excess else 0)), need, 1)


def aligned_sizes(S: int, Bs: int) -> list[int]:
    """Every A `bucket_blocks` can give for rows of S tokens: ceil(log2(S - Q)) + 2 at most."""
    Q = -(-S // Bs)
    return sorted({bucket_blocks(need, S, Bs) for need in range(Q, max(S, Q) + 1)})


def _span_extent(doc_BS: Tensor, span_BS: Tensor) -> tuple[Tensor, Tensor]:
    """Per token: first and last row position of its (document, span) group, by a stable lexical
    sort (no host sync). Only visual tokens' values are used."""
    B, S = doc_BS.shape
    by_span_BS = torch.sort(span_BS, dim=1, stable=True).indices
    order_BS = by_span_BS.gather(1, torch.sort(doc_BS.gather(1, by_span_BS), dim=1, stable=True).indices)
    sdoc_BS, sspan_BS = doc_BS.gather(1, order_BS), span_BS.gather(1, order_BS)
    if S == 0:
        return order_BS, order_BS
    change_BS = (sdoc_BS[:, 1:] != sdoc_BS[:, :-1]) | (sspan_BS[:, 1:] != sspan_BS[:, :-1])
    new_BS = F.pad(change_BS, (1, 0), value=True)
    idx_BS = torch.arange(S, device=doc_BS.device).expand(B, S)
    run_first_BS = torch.where(new_BS, idx_BS, 0).cummax(1).values  # sorted index of the run's start
    end_BS = F.pad(new_BS[:, 1:], (0, 1), value=True)
    run_last_BS = torch.where(end_BS, idx_BS, S).flip(1).cummin(1).values.flip(1)
    # positions are sorted inside a run (stable sorts): first/last = the run's ends
    first_BS = torch.empty_like(order_BS).scatter_(1, order_BS, order_BS.gather(1, run_first_BS))
    last_BS = torch.empty_like(order_BS).scatter_(1, order_BS, order_BS.gather(1, run_last_BS))
    return first_BS, last_BS


def _doc_ranks(doc_BS: Tensor, Bs: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> rank in document, row position of the document's first token, aligned block of the
    document's block 0, and aligned blocks per row. Documents are grouped by a stable sort."""
    B, S = doc_BS.shape
    order_BS = torch.sort(doc_BS, dim=1, stable=True).indices  # tokens of a document together
    sdoc_BS = doc_BS.gather(1, order_BS)
    idx_BS = torch.arange(S, device=doc_BS.device).expand(B, S)
    start_BS = F.pad(sdoc_BS[:, 1:] != sdoc_BS[:, :-1], (1, 0), value=True)
    end_BS = F.pad(start_BS[:, 1:], (0, 1), value=True)
    run_first_BS = torch.where(start_BS, idx_BS, 0).cummax(1).values
    srank_BS = idx_BS - run_first_BS
    blocks_BS = torch.where(end_BS, srank_BS // Bs + 1, 0)  # a document's blocks, at its last token
    cum_BS = blocks_BS.cumsum(1)
    sbase_BS = cum_BS - blocks_BS  # blocks of the documents before (constant along a document)
    rank_BS = torch.empty_like(srank_BS).scatter_(1, order_BS, srank_BS)
    first_BS = torch.empty_like(srank_BS).scatter_(1, order_BS, order_BS.gather(1, run_first_BS))
    base_BS = torch.empty_like(srank_BS).scatter_(1, order_BS, sbase_BS)
    return rank_BS, first_BS, base_BS, cum_BS[:, -1]


@torch.no_grad()
def build_meta(doc_ids_BS: Tensor, span_ids_BS: Tensor, block_size: int, max_docs: int = 0,
               knockout_BS: Tensor | None = None) -> AttnMeta:
    """Build the metadata once per forward; every layer (and every backend) reuses it. No host
    synchronisation: three steps of tensor ops (documents, spans; host values lazily, in AttnMeta).

    doc_ids (B, S): document of each token (ids < 0: padding); span_ids (B, S): visual span of
    each visual token (>= 0; unique within a document), -1 for text; max_docs: a per-row cap on
    documents (padding runs count) that makes the aligned layout's length static (0: none);
    knockout (B, S) bool: tokens knocked out as keys (knockout.py), None for none."""
    if doc_ids_BS.shape != span_ids_BS.shape or doc_ids_BS.dim() != 2:
        raise ValueError(f"doc_ids/span_ids: need equal (B, S) shapes (got {tuple(doc_ids_BS.shape)} "
                         f"and {tuple(span_ids_BS.shape)})")
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1 (got {block_size})")
    dev, Bs = doc_ids_BS.device, block_size
    B, S = doc_ids_BS.shape
    doc_BS, span_BS = doc_ids_BS.long(), span_ids_BS.long()
    # 1. documents: rank of every token, its document's first token, aligned blocks
    rank_BS, first_BS, base_BS, blocks_B = _doc_ranks(doc_BS, Bs)
    # 2. visual spans: key, last position and doc-relative block range (text: its own key)
    pos_BS = torch.arange(S, device=dev).expand(B, S)
    vis_BS = span_BS >= 0
    f_BS, l_BS = _span_extent(doc_BS, span_BS)
    skey_BS = torch.where(vis_BS, f_BS, -(pos_BS + 1))
    span_last_BS = torch.where(vis_BS, l_BS, pos_BS)
    span_lo_BS = torch.where(vis_BS, rank_BS.gather(1, f_BS) // Bs, NO_SPAN)
    span_hi_BS = torch.where(vis_BS, rank_BS.gather(1, l_BS) // Bs, -1)
    # 3. what needs the host (has_spans, docs_contiguous, aligned_blocks) is computed on first use
    return AttnMeta(
        block_size=Bs, seq_len=S, doc_BS=doc_BS, skey_BS=skey_BS, rank_BS=rank_BS, first_BS=first_BS,
        span_last_BS=span_last_BS, span_lo_BS=span_lo_BS, span_hi_BS=span_hi_BS,
        ablk_BS=base_BS + rank_BS // Bs, base_BS=base_BS, vis_BS=vis_BS, blocks_B=blocks_B,
        null=doc_BS.amin() - 1 if S else doc_BS.new_tensor(-1), max_docs=max_docs,
        knock_BS=None if knockout_BS is None else check_knockout(knockout_BS, doc_BS),
    )


def check_knockout(knock_BS: Tensor, doc_BS: Tensor) -> Tensor:
    if knock_BS.shape != doc_BS.shape:
        raise ValueError(f"knockout: need the (B, S) shape of doc_ids {tuple(doc_BS.shape)} "
                         f"(got {tuple(knock_BS.shape)})")
    return knock_BS.to(device=doc_BS.device, dtype=torch.bool)


def _aligned(meta: AttnMeta) -> AlignedLayout:
    """Scatter the row's per-token tables into the aligned layout (empty slots get `null`)."""
    B, S, Bs, A = meta.batch, meta.seq_len, meta.block_size, meta.aligned_blocks
    L, dev = A * Bs, meta.doc_BS.device
    if meta.max_docs and S:  # a static A: the cap is a promise, checked without a host sync on CUDA
        torch._assert_async(meta.blocks_B.max() <= A, f"max_docs: a row holds > {meta.max_docs} documents")
    slot_BS = meta.base_BS * Bs + meta.rank_BS
    pos_BS = torch.arange(S, device=dev).expand(B, S)

    def scatter(x_BS: Tensor, empty) -> Tensor:
        out_BL = x_BS.new_full((B, L), empty) if not isinstance(empty, Tensor) else empty.expand(B, L).clone()
        return out_BL.scatter_(1, slot_BS, x_BS)

    empty_key_L = -(S + 1 + torch.arange(L, device=dev))  # unique, never a token's key
    first_BA = torch.arange(A, device=dev).expand(B, A).clone().scatter_(1, meta.ablk_BS, meta.base_BS)
    vis_BA = torch.zeros(B, A, dtype=torch.bool, device=dev).scatter_reduce(
        1, meta.ablk_BS, meta.vis_BS, "amax")
    real_BA = torch.zeros(B, A, dtype=torch.bool, device=dev).scatter_reduce(
        1, meta.ablk_BS, meta.real_BS, "amax")
    count_BA = torch.zeros(B, A, device=dev).scatter_add_(1, meta.ablk_BS, torch.ones(B, S, device=dev))
    return AlignedLayout(
        block_size=Bs, aligned_blocks=A, slot_BS=slot_BS, src_BL=scatter(pos_BS, -1),
        doc_BL=scatter(meta.doc_BS, meta.null),
        skey_BL=scatter(meta.skey_BS, empty_key_L), span_lo_BL=scatter(meta.span_lo_BS, NO_SPAN),
        span_hi_BL=scatter(meta.span_hi_BS, -1), first_BA=first_BA, vis_BA=vis_BA, count_BA=count_BA,
        real_BA=real_BA,
    )
