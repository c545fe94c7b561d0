"""The loss-term registry (mmtrain/objectives/loss_terms/): a term registered in one place gets its
config section and its field of the step's sums, and the objective runs its hooks -- a new term
adds its loss and its report with no edit to the objective."""

from __future__ import annotations

import dataclasses

import test_objective
import torch
from test_objective import objective, one_step

from mmtrain.objectives.loss_terms import TERMS, Reported, Term
from mmtrain.objectives.loss_terms.base import register
from mmtrain.objectives.objective import LossConfig, StepSums

setup = test_objective.setup  # the fixture: a config maker, a model, a batch


def test_every_term_with_a_config_or_sums_has_its_section_and_field():
    sections = {f.name for f in dataclasses.fields(LossConfig)}
    fields = {f.name: f for f in dataclasses.fields(StepSums)}
    for name, cls in TERMS.items():
        if cls.Config is not None:
            assert name in sections and isinstance(getattr(LossConfig(), name), cls.Config), name
        assert (name in fields) == (cls.Sums is not None), name
        if cls.Sums is not None:  # a fresh one per step
            assert StepSums().__dict__[name] == cls.Sums()


class _Hidden2(Term):
    """A toy term: weight x mean squared final hidden state; counts its calls."""

    name = "hidden2"
    calls: list[str] = []

    @classmethod
    def enabled(cls, loss_cfg) -> bool:
        return True

    def before_forward(self, mb) -> None:
        self.calls.append("before_forward")

    def loss(self, mb) -> torch.Tensor:
        self.calls.append("loss")
        self.value = 0.5 * mb.out.hidden_BSD.float().square().mean()
        return self.value

    @classmethod
    def report(cls, loss_cfg, total, accum, world, rep: Reported) -> None:
        rep.terms["hidden2"] = 1.0


def test_a_registered_term_is_added_to_the_loss_and_the_report(setup):
    make, model, batch = setup
    loss0, _ = one_step(objective(make, model), batch)
    register(_Hidden2)
    try:
        with_toy = objective(make, model)
        loss1, sums = one_step(with_toy, batch)
        stats = with_toy.end_step(sums, grad_norm=1.0, skipped=False, started=0.0)
    finally:
        del TERMS[_Hidden2.name]
    term = next(t for t in with_toy.terms if t.name == "hidden2")
    assert _Hidden2.calls == ["before_forward", "loss"]
    torch.testing.assert_close(loss1, loss0 + term.value, rtol=1e-6, atol=1e-6)
    assert stats.terms["hidden2"] == 1.0
