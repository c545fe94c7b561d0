"""Mixture of Experts: fine-grained routed SwiGLU experts + shared expert(s), in three parts with
seams (torchtitan's shape):

- `router.py`: scores, top-k on score + bias (DeepSeek-V3 auxiliary-loss-free balancing), the
  sequence-level balance loss, router z-loss, per-modality load and entropy; optional modality
  groups (MoMa).
- `dispatch.py`: where each (token, expert) row is computed: `LocalDispatcher` sorts by expert and
  back; the expert-parallel one (mmtrain/parallel/expert_parallel.py) uses an all-to-all.
- `experts.py`: stacked expert weights and the registry of paths that run them (grouped_mm,
  batched, loop), with `experts_reference`, the no-sorting reference.

`layer.py` composes them; `config.py` holds MoEConfig. Dropless: no routed row is ever dropped.
"""

from .config import MoEConfig
from .layer import LEGACY_NAMES, MoE
from .router import N_MODALITIES, Router, Routing, route, seq_balance_loss

__all__ = ["LEGACY_NAMES", "N_MODALITIES", "MoE", "MoEConfig", "Router", "Routing", "route",
           "seq_balance_loss"]
