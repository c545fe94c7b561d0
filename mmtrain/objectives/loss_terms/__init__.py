"""Loss terms beyond the task cross-entropies: a registry (base.py), one file a term. The imports
below set the order the objective runs their hooks and adds their losses in (the order the losses
were always added in: changing it changes the loss's last bits). A new term: one file with a
`Term` subclass under `@register`, and its import here; its `Config` becomes the section
`loss.<name>` and its `Sums` a field of the step's sums.
"""

from __future__ import annotations

# isort: off
from mmtrain.objectives.loss_terms import token_weighting  # noqa: F401  (they register, in this order)
from mmtrain.objectives.loss_terms import moe_aux  # noqa: F401
from mmtrain.objectives.loss_terms import visual_ssl  # noqa: F401
from mmtrain.objectives.loss_terms import visual_next  # noqa: F401
from mmtrain.objectives.loss_terms import contrast  # noqa: F401
from mmtrain.objectives.loss_terms import z_loss  # noqa: F401
# isort: on
from mmtrain.objectives.loss_terms.base import TERMS, MicroBatch, Reported, Term

__all__ = ["TERMS", "MicroBatch", "Reported", "Term"]
