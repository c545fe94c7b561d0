"""Per-part gradient norms and update ratios (mmtrain/loop/grad_parts.py): on log steps only, the
parts' squares adding up to the global pre-clip norm's, a frozen ViT's ratio exactly 0, and under
FSDP2 + expert parallelism (gloo, 2 ranks) the same figures as one process."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from dist_runs import HERE as WORKER
from dist_runs import launch, parity_reference, step_records, write_config

from mmtrain.loop import grad_parts
from mmtrain.loop.logger import RunLogger
from mmtrain.loop.trainer import Trainer

PARTS = grad_parts.PARTS
KEYS = {f"{kind}/{part}" for kind in ("grad_norm", "update_ratio") for part in PARTS}
RUN = ["train.steps=4", "train.ckpt_every=0", "train.log_every=2"]


def _trainer(make_config, run_dir, overrides, monkeypatch):
    """A tiny run's trainer; -> (it, TensorBoard scalars by step, one entry per measurement)."""
    calls, tb = [], {}
    inner = grad_parts.part_params
    monkeypatch.setattr(grad_parts, "part_params", lambda model: calls.append(1) or inner(model))
    monkeypatch.setattr(RunLogger, "scalars", lambda self, step, kv: tb.setdefault(step, {}).update(kv))
    return Trainer(make_config(run_dir, [*RUN, *overrides]), verbose=False), tb, calls


def _parts(trainer) -> dict[str, list[torch.Tensor]]:
    return grad_parts.part_params(trainer.raw_model)


def test_parts_logged_on_log_steps_only_and_add_up_to_the_global_norm(make_config, tmp_path, monkeypatch):
    trainer, tb, calls = _trainer(make_config, tmp_path / "run", ["train.faults.nan_at_step=4"], monkeypatch)
    trainer.fit()
    recs = step_records(tmp_path / "run")
    assert sorted(recs) == [1, 2, 3, 4]
    assert not KEYS & (set(recs[1]) | set(recs[3]))
    assert len(calls) == 3  # step 2: grads and update; step 4 (skipped): grads only
    rec = recs[2]
    assert set(rec) >= KEYS and {k: tb[2][k] for k in KEYS} == {k: rec[k] for k in KEYS}
    squares = sum(rec[f"grad_norm/{p}"] ** 2 for p in PARTS)
    assert squares == pytest.approx(rec["grad_norm"] ** 2, rel=1e-5)  # the pre-clip global norm
    assert all(0 < rec[f"update_ratio/{p}"] < 1 for p in PARTS)
    assert recs[4]["skipped"] and {k for k in KEYS if k in recs[4]} == {f"grad_norm/{p}" for p in PARTS}


def test_frozen_vit_has_no_update_while_projector_and_decoder_train(make_config, tmp_path, monkeypatch):
    overrides = ["optim.vision_lr_mult=0", "optim.vision_weight_decay=0.5"]
    trainer, _, _ = _trainer(make_config, tmp_path / "run", overrides, monkeypatch)
    start = {p: [t.detach().clone() for t in ts] for p, ts in _parts(trainer).items()}
    trainer.fit()
    recs = step_records(tmp_path / "run")
    after = _parts(trainer)
    assert all(start[p] for p in PARTS)
    assert all(torch.equal(a, b) for a, b in zip(after["vision"], start["vision"]))  # bit for bit
    for part in ("projector", "decoder"):
        assert any(not torch.equal(a, b) for a, b in zip(after[part], start[part])), part
    for step in (2, 4):
        assert recs[step]["update_ratio/vision"] == 0.0
        assert recs[step]["grad_norm/vision"] > 0  # gradients still flow into the ViT
        assert recs[step]["update_ratio/projector"] > 0 and recs[step]["update_ratio/decoder"] > 0


@pytest.mark.distributed
def test_fsdp_and_expert_parallel_log_what_one_process_does(make_raw, tmp_path):
    """2 ranks (FSDP2, ep=2: dense and expert meshes) on the rows one process reads in full."""
    overrides = ["data.batch_size=4", "dist.strategy=fsdp", "dist.ep=2"]
    config = write_config(make_raw, tmp_path / "run", overrides)
    parity_reference(config, tmp_path / "one.json", 3)
    launch([str(WORKER), "parity", str(config), str(tmp_path / "two.json"), "3"], nproc=2)
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    for a, b, norm in zip(one["parts"], two["parts"], two["grad_norm"]):
        assert set(a) == set(b) == KEYS
        assert b == pytest.approx(a, rel=1e-4, abs=0)
        assert sum(b[f"grad_norm/{p}"] ** 2 for p in PARTS) == pytest.approx(norm ** 2, rel=1e-5)


def test_measuring_leaves_training_bit_identical(make_config, tmp_path, monkeypatch):
    def run(name: str) -> tuple[list[float], int]:
        trainer, _, calls = _trainer(make_config, tmp_path / name, [], monkeypatch)
        trainer.fit()
        recs = step_records(tmp_path / name)
        return [recs[s]["loss"] for s in sorted(recs)], len(calls)

    measured, n = run("measured")
    monkeypatch.setattr(grad_parts.GradParts, "measure_grads", lambda self: None)
    monkeypatch.setattr(grad_parts.GradParts, "measure_update", lambda self, due: contextlib.nullcontext())
    plain, none = run("plain")
    assert n and not none and measured == plain
