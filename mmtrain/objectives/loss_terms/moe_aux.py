"""The model's auxiliary losses (MoE sequence balance, router z-loss): always on when the model has
them; means over rows / token slots, so each rank adds its share 1 / world.

A pipeline's micro-batch may be a part of the forward one process runs (a row part of the batch,
rows of padding to the stages' fixed shape: `mb.ref`, that forward's inputs): then each mean is
rescaled to that forward's divisor -- the z-loss's token slots (rows x S) and the sequence balance's
rows with a real token -- so the parts add up to one process's terms. (Exact when the experts form
one group; with modality groups a row counts per group, and the balance's parts are approximate.)"""

from __future__ import annotations

import torch

from mmtrain.objectives.loss_terms.base import MicroBatch, Term, register


def _rows(inputs: dict) -> tuple[int, torch.Tensor]:
    """(rows, rows holding a real token) of a forward's inputs (no host sync: the second a tensor)."""
    doc_BS = inputs["doc_ids_BS"]
    return doc_BS.shape[0], (doc_BS >= 0).any(1).sum()


@register
class MoEAux(Term):
    name = "moe_aux"

    @classmethod
    def enabled(cls, loss_cfg) -> bool:
        return True

    def loss(self, mb: MicroBatch) -> list[torch.Tensor]:
        aux, n = mb.out.aux_losses, mb.world
        if mb.ref is not None:
            (rows, real), (ref_rows, ref_real) = _rows(mb.inputs), _rows(mb.ref)
            scale = {"router_z": rows / ref_rows, "moe_seq_balance": real / ref_real.clamp(min=1)}
            return [value * scale[name] / n for name, value in aux.items()]
        return [value / n if n > 1 else value for value in aux.values()]
