"""Trainers on the tiny test config and one micro-batch through their objective, shared by the
tests of the objective's extra terms (token weighting, the mismatch contrast)."""

from __future__ import annotations

from mmtrain.config import apply_override, from_dict
from mmtrain.loop.trainer import Trainer
from mmtrain.run_config import RunConfig


def make_trainer(raw_for, tmp_path_factory, tag: str, overrides=()) -> Trainer:
    """A quiet Trainer on the tiny test config, 4 rows a batch, no checkpoints, plus `overrides`."""
    raw = raw_for(tmp_path_factory.mktemp(tag))
    for item in ["data.batch_size=4", "train.ckpt_every=0", *overrides]:
        apply_override(raw, item)
    return Trainer(from_dict(RunConfig, raw, source=f"{tag}-test"), verbose=False)


def one_step(trainer: Trainer, batch):
    """One micro-batch from the trainer's initial weights: (loss, grads, the step's sums); the MoE
    load counters are reset after, so the next call starts from the same state."""
    trainer.model.train()
    trainer.optimizer.zero_grad(set_to_none=True)
    sums = trainer.objective.begin_step(trainer.step)
    loss = trainer.objective.micro_batch(batch, sums)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.raw_model.named_parameters() if p.grad is not None}
    for moe in trainer.raw_model.moe_layers().values():
        moe.load_E.zero_()
    return loss.detach(), grads, sums.floats()  # device tensors until the step reads them
