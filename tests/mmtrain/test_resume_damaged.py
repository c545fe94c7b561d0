"""A damaged newest checkpoint: resume takes the previous one that verifies and continues with
exactly the losses of the uninterrupted run. Also: loading never runs pickled code, and exports
are atomic, world-readable and carry the tokenizer."""

from __future__ import annotations

import json
import shutil
import stat

import pytest
import torch

from mmtrain.cli import main
from mmtrain.errors import UserError
from mmtrain.loop.trainer import Trainer
from mmtrain.state.checkpoint import Checkpointer, load_state

OVERRIDES = ["train.steps=6", "train.ckpt_every=2", "train.keep_last=3", "train.eval_batches=1"]


def step_losses(run) -> dict[int, float]:
    """metrics.jsonl by step; a step replayed after a resume: the later line wins."""
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def damage(file, how: str) -> None:
    data = file.read_bytes()
    if how == "truncate":
        file.write_bytes(data[: len(data) // 2])
    else:  # one flipped byte in the middle: same size, different content
        i = len(data) // 2
        file.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, raw_for):
    from mmtrain.config import apply_override, from_dict
    from mmtrain.run_config import RunConfig

    run = tmp_path_factory.mktemp("damaged") / "ref"
    raw = raw_for(run)
    for item in OVERRIDES:
        apply_override(raw, item)
    Trainer(from_dict(RunConfig, raw), verbose=False).fit()
    return run


def test_each_damaged_file_of_the_newest_checkpoint_falls_back_exactly(reference, make_config, tmp_path):
    expected = step_losses(reference)
    newest = reference / "step_6"
    files = sorted(str(p.relative_to(newest)) for p in newest.rglob("*") if p.is_file())
    assert len(files) >= 7  # config, dcp metadata + shard, manifest, rank file, state, tokenizer
    for i, name in enumerate(files):
        run = tmp_path / f"run{i}"
        shutil.copytree(reference, run)
        damage(run / "step_6" / name, "truncate" if i % 2 else "flip")
        trainer = Trainer(make_config(run, OVERRIDES), verbose=False)
        assert trainer.resumed_from == run / "step_4", name
        assert f"skipped damaged checkpoint {run / 'step_6'}" in trainer.resume_note
        trainer.fit()
        got = step_losses(run)
        assert [got[s] for s in (5, 6)] == [expected[s] for s in (5, 6)], name
        assert "skipped damaged checkpoint" in (run / "train.log").read_text()


def test_no_checkpoint_that_verifies_is_an_error_not_a_fresh_start(reference, make_config, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    for step in (2, 4, 6):
        damage(run / f"step_{step}" / "state.pt", "flip")
    with pytest.raises(UserError, match="no checkpoint verifies.*step_6: state.pt does not match"):
        Trainer(make_config(run, OVERRIDES), verbose=False)


class _Evil:
    def __reduce__(self):
        return (exec, ("raise SystemExit('code ran on load')",))


def test_loading_never_runs_pickled_code(tmp_path):
    (tmp_path / "step_1").mkdir()
    torch.save({"config": {}, "payload": _Evil()}, tmp_path / "step_1" / "state.pt")
    with pytest.raises(UserError, match="cannot read checkpoint"):
        load_state(tmp_path / "step_1")
    assert Checkpointer(tmp_path, 1).newest_valid() == (tmp_path / "step_1", [])  # no manifest: as it is


def test_export_is_atomic_world_readable_and_takes_a_tokenizer_directory(reference, tmp_path, monkeypatch):
    out = tmp_path / "export"
    assert main(["export", str(reference), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.safetensors", "tokenizer.json"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in out.iterdir())
    # a checkpoint without its tokenizer copy: the one data.tokenizer names (here a directory)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference / "step_6", ckpt)
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "manifest.json").unlink()
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    shutil.copyfile(reference / "step_6" / "tokenizer.json", tok_dir / "tokenizer.json")
    state = load_state(ckpt)
    state["config"]["data"]["tokenizer"] = str(tok_dir)
    torch.save(state, ckpt / "state.pt")
    import safetensors.torch

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):  # the old export stays whole
        main(["export", str(ckpt), "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.safetensors", "tokenizer.json"]
    monkeypatch.undo()
    (out / "tokenizer.json").unlink()
    assert main(["export", str(ckpt), "--out", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert main(["export", str(ckpt), "--out", str(tmp_path / "mine")]) == 2  # not an export: refused
