"""The model's auxiliary losses (MoE sequence balance, router z-loss): always on when the model has
them. Each is a mean over this forward's rows with a real token (the balance) or its token slots
(the z-loss); a rank's term is that mean times its forward's share of the global batch's rows /
slots, so the ranks' terms add up to one process's means over the global batch, whatever rows each
forward holds (the contrast's copies, a pipeline's row parts and padding rows: the divisors are of
`mb.ref`, the forward one process runs). The ranks of a row's cp x tp group hold its chunks: each
adds 1 / (cp x tp). (Exact when the experts form one group; with modality groups a row counts per
group, and the balance is approximate.)"""

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

    def row_count(self, mb: MicroBatch) -> tuple:
        return _rows(mb.inputs if mb.ref is None else mb.ref)

    def loss(self, mb: MicroBatch) -> list[torch.Tensor]:
        (rows, real), (all_rows, all_real) = _rows(mb.inputs), mb.row_counts[self.name]
        seq = self.obj.cfg.dist.cp * self.obj.cfg.dist.tp
        share = {"router_z": rows / (all_rows * seq), "moe_seq_balance": real / (all_real * seq).clamp(min=1)}
        return [value * share[name] for name, value in mb.out.aux_losses.items()]
