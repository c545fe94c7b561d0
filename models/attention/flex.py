"""The `flex` backend: FlexAttention with a BlockMask built from the selected blocks + the token rule.

Blocks selected whose every (i, j) pair is allowed (earlier block, one document, no padding) go in
the BlockMask's "full" lists (no mask_mod evaluated there); the rest are "partial" and evaluate
the token rule. The mask_mod also tests the block selection itself: FlexAttention's contract is
that mask_mod is the ground truth and the BlockMask only an optimisation (the unfused eager path
ignores the block lists), so both must say the same thing. The compiled kernel is the CUDA
training path; on CPU (torch 2.13) compiled flex is inference only, so `attend_flex` refuses to
build a graph for backward there.

Flex's Triton kernels need the BlockMask's block size to be a multiple of their tiles (64/128), so
the BlockMask is built at Bf = lcm(Bs, 128) (a coarse block is listed if any of its Bs-blocks is
selected; "full" only if all are) while mask_mod tests the exact Bs-block selection.

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, Q query blocks, N key blocks,
G selection heads (H, K or 1), Bs block size, Bf = lcm(Bs, 128) flex block size, f = Bf // Bs,
X / Y coarse query / key blocks.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .meta import AttnMeta, token_mask

Tensor = torch.Tensor


@functools.cache
def compiled_flex():
    """torch.compile(flex_attention), built once per process (no module-level state)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _kv_lists(sel_BGQN: Tensor) -> tuple[Tensor, Tensor]:
    num_BGQ = sel_BGQN.sum(-1).to(torch.int32)
    idx_BGQN = (~sel_BGQN).to(torch.uint8).sort(dim=-1, stable=True).indices.to(torch.int32)
    return num_BGQ, idx_BGQN


def build_block_mask(meta: AttnMeta, sel_BGQN: Tensor | None, H: int):
    """BlockMask for a full layer (sel None: every reachable block) or a sparse one."""
    from torch.nn.attention.flex_attention import BlockMask

    sel_BGQN = meta.reach_BQN[:, None] if sel_BGQN is None else sel_BGQN
    if sel_BGQN.shape[1] not in (1, H):
        sel_BGQN = sel_BGQN.repeat_interleave(H // sel_BGQN.shape[1], 1)
    # Tables long enough for any kernel tile overrun past the padded length.
    extra = 2 * max(128, meta.block_size)
    doc_BX = torch.cat([meta.doc_BP, meta.doc_BP[:, -1:].expand(-1, extra)], 1)  # no host sync
    span_BX = F.pad(meta.span_BP, (0, extra), value=-1)

    Bs, G = meta.block_size, sel_BGQN.shape[1]
    nx = doc_BX.shape[1] // Bs + 1
    sel_BGXX = F.pad(sel_BGQN, (0, nx - sel_BGQN.shape[-1], 0, nx - sel_BGQN.shape[-2]))

    def mask_mod(b, h, q_idx, kv_idx):
        rule = token_mask(doc_BX[b, q_idx], span_BX[b, q_idx], q_idx, doc_BX[b, kv_idx], span_BX[b, kv_idx],
                          kv_idx)
        return rule & sel_BGXX[b, h if G > 1 else 0, q_idx // Bs, kv_idx // Bs]

    Bf = math.lcm(Bs, 128)
    full_BGXY = _coarsen(sel_BGQN & meta.full_BQN[:, None], Bf // Bs, "all")
    part_BGXY = _coarsen(sel_BGQN, Bf // Bs, "any") & ~full_BGXY  # a block sits in one list only
    n_part, i_part = _kv_lists(part_BGXY)
    n_full, i_full = _kv_lists(full_BGXY)
    S = meta.seq_len
    return BlockMask.from_kv_blocks(n_part, i_part, n_full, i_full, BLOCK_SIZE=Bf, mask_mod=mask_mod,
                                    seq_lengths=(S, S))


def _coarsen(x_BGQN: Tensor, f: int, how: str) -> Tensor:
    """(B, G, Q, N) -> (B, G, X, Y) over f x f groups of blocks ("any" / "all"; padding counts False)."""
    if f == 1:
        return x_BGQN
    B, G, Q, _ = x_BGQN.shape
    X = -(-Q // f)
    x_BGQN = F.pad(x_BGQN, (0, X * f - Q, 0, X * f - Q))
    x_BGXfYf = x_BGQN.view(B, G, X, f, X, f)
    return x_BGXfYf.any(5).any(3) if how == "any" else x_BGXfYf.all(5).all(3)


def attend_flex(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta, sel_BGQN: Tensor | None,
                compiled: bool = True) -> Tensor:
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_BHSD, k_BKSD, v_BKSD))
    if needs_grad and q_BHSD.device.type != "cuda":
        raise RuntimeError("backend: flex has no backward on CPU in this torch; use 'gather' or 'auto'")
    H, K = q_BHSD.shape[1], k_BKSD.shape[1]
    if sel_BGQN is None:  # full layers share one BlockMask per forward
        if ("flex_full", H) not in meta.cache:
            meta.cache[("flex_full", H)] = build_block_mask(meta, None, H)
        block_mask = meta.cache[("flex_full", H)]
    else:
        block_mask = build_block_mask(meta, sel_BGQN, H)
    if compiled:
        fn = compiled_flex()
    else:
        from torch.nn.attention.flex_attention import flex_attention as fn
    return fn(q_BHSD, k_BKSD, v_BKSD, block_mask=block_mask, enable_gqa=H != K)
