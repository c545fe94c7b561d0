"""The signals a balancer may declare, who provides each, and what the run config must have for it.

    task_loss       step: per-token mean loss of each task in the step (all ranks)   (objective)
    head_grad_norm  step: ||d L_task / d W_lm_head|| per task, closed form           (objective)
    reliance_gap    diagnostics: loss with the media blanked - with them, per media task
    mismatch_gap    diagnostics: loss with another document's media - with its own

`check_signals(cfg, signals, who)` is RunConfig's one check for any declaring component: a
diagnostics signal needs `diagnostics.every`.

The step signals hold under any split of the rows (dist.cp, dist.tp: each rank holds a chunk of
every row). task_loss is the all-reduced sums over the all-reduced counts. head_grad_norm: each rank
forms the closed-form gradient of its own tokens, each divided by its task's trained tokens on every
rank (the objective's global counts), against the whole LM head (FSDP-gathered; tp does not split
the head), and the (tasks, V, D) gradients are all-reduced over the world before the norm: the sum
of the chunks' gradients is the whole rows' (tests: CP(2), TP(2) GradNorm parity with one process).
Under dist.pp only the last stage's ranks form them (the loss runs there); the other stages add
zeros to the same all-reduce (PP(2) parity, its rows split into row parts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Signal:
    source: str  # "step" (the objective, after each step not skipped) | "diagnostics" (each run)
    attr: str = ""  # diagnostics: the DiagResult property that holds it
    needs: str = ""  # diagnostics: a DiagConfig flag that must be on besides `every`


SIGNALS = {
    "task_loss": Signal("step"),
    "head_grad_norm": Signal("step"),
    "reliance_gap": Signal("diagnostics", attr="reliance_gap"),
    "mismatch_gap": Signal("diagnostics", attr="mismatch_gap", needs="mismatch"),
}


def check_signals(cfg: Any, signals: tuple[str, ...], who: str) -> None:
    """Raise ValueError naming `who` (a dotted key and its value) when `cfg` (a RunConfig) cannot
    provide one of `signals`."""
    for name in signals:
        sig = SIGNALS[name]
        if sig.source == "diagnostics" and not cfg.diagnostics.every:
            raise ValueError(f"{who} reads the {name} of the diagnostics: set diagnostics.every > 0")
        if sig.needs and not getattr(cfg.diagnostics, sig.needs):
            raise ValueError(f"{who} reads the {name}: set diagnostics.{sig.needs}: true")
