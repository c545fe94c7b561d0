"""Key knockout: tokens made invisible to every other token, in every layer (an analysis input).

`build_meta(..., knockout_BS=...)` (the decoder's `forward(knockout_BS=...)`) marks tokens knocked
out. The rule, one definition for every backend: a knocked-out token's key gets zero weight in the
softmax of every *other* query (its own row still attends it, so no row is ever empty and nothing
is NaN), and it does not enter the block means that sparse layers score their picks with (keys,
and with select == "block" the previous block's mean query). So what it holds reaches no other
token: a mask, not a change of the input, which stays in distribution (the attention-map tool's
faithfulness, tools/attention_maps/faithfulness.py).

Backends state support in the registry (`Backend.knockout`); a call with a knockout that the
asked backend does not support runs on `dense`, the reference, whose mask (`dense.rule_rows`,
also what `recompute_probs` uses) applies the rule. Not under torch.compile or context
parallelism (an error: both are training paths).

Legend: B batch rows, S tokens, R query rows, A aligned blocks, Bs block size, L = A * Bs slots.
"""

from __future__ import annotations

import torch

from .meta import AttnMeta

Tensor = torch.Tensor


def visible_keys(meta: AttnMeta, b_R: Tensor, i_R: Tensor) -> Tensor | None:
    """(R, S) bool: the keys query rows (b_R, i_R) may see under the knockout (None: no knockout)."""
    if meta.knock_BS is None:
        return None
    pos_S = torch.arange(meta.seq_len, device=meta.doc_BS.device)
    return ~meta.knock_BS[b_R] | (pos_S[None] == i_R[:, None])


def live_slots(meta: AttnMeta) -> Tensor | None:
    """(B, L) bool: aligned slots holding a token that is not knocked out (None: no knockout)."""
    if meta.knock_BS is None:
        return None
    src_BL = meta.aligned().src_BL
    return (src_BL >= 0) & ~meta.knock_BS.gather(1, src_BL.clamp_min(0))


def check_call(meta: AttnMeta, compiling: bool, context: object) -> None:
    """A knockout runs eagerly on whole rows (the opaque ops and context parallelism rebuild or
    split the metadata without it)."""
    if meta.knock_BS is not None and (compiling or context is not None):
        raise ValueError("knockout: runs eagerly on whole rows (not under torch.compile or context "
                         "parallelism)")
