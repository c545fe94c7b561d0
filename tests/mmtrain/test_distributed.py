"""Scale-out on CPU with gloo: FSDP2 parity with one process, kill-and-resume exactness, resharding
between world sizes, non-finite steps agreed by all ranks, export of sharded checkpoints.

Every run is a subprocess (`python` or `torchrun --standalone`) with one thread per process, so
one-process and two-process results compare bit for bit where they should. This file is also
the parity worker: `python tests/mmtrain/test_distributed.py parity CONFIG OUT`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = pytest.mark.distributed

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
STEPS = 8
# small but complete: both task kinds with media, MoE, sparse layers; one val batch per rank
RUN_OVERRIDES = ["dist.timeout_s=60", "train.threads=1", "train.eval_batches=1", "train.log_every=1",
                 f"train.steps={STEPS}", "train.ckpt_every=2", "train.keep_last=4"]


# ----- helpers ---------------------------------------------------------------------------------
def write_config(make_raw, run_dir: Path, overrides=()) -> Path:
    from mmtrain.config import apply_override

    raw = make_raw(run_dir)
    for item in [*RUN_OVERRIDES, *overrides]:
        apply_override(raw, item)
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def launch(args: list[str], nproc: int = 1, max_restarts: int = 0, timeout: float = 240,
           check: bool = True) -> subprocess.CompletedProcess:
    """`python ARGS` or `torchrun --standalone --nproc-per-node N ARGS`, one thread per process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                f"--max-restarts={max_restarts}", "--monitor-interval=0.2"]
    # its own session: on a timeout the whole tree goes (torchrun alone would orphan its workers)
    with subprocess.Popen(cmd + args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            raise AssertionError(f"{' '.join(cmd + args)} timed out:\n{err[-4000:]}") from None
    proc = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd + args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def train(config: Path, nproc: int = 1, *overrides: str, **kw) -> subprocess.CompletedProcess:
    sets = [a for o in overrides for a in ("--set", o)]
    return launch(["-m", "mmtrain.train", str(config), "--quiet", *sets], nproc, **kw)


def step_records(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by step; a step replayed after a resume: the later line wins. (Eval lines,
    e.g. the captioning eval's, are left out.)"""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "eval" not in rec:
            out[rec["step"]] = rec
    return out


def losses(run_dir: Path) -> list[float]:
    recs = step_records(run_dir)
    assert sorted(recs) == list(range(1, STEPS + 1)), sorted(recs)
    return [recs[s]["loss"] for s in range(1, STEPS + 1)]


def checkpoint_names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith((".step_", "step_")))


# ----- parity ------------------------------------------------------------------------------------
def split_rows(batch, rank: int, world: int):
    """Rank `rank`'s rows of a batch, with its media, patches and renumbered media ids."""
    from dataclasses import replace

    B = batch.tokens_BS.shape[0]
    lo, hi = rank * B // world, (rank + 1) * B // world
    before = batch.media_ids_BS[:lo]
    m0 = int(before.max()) + 1 if (before >= 0).any() else 0
    mine = batch.media_ids_BS[lo:hi]
    m1 = int(mine.max()) + 1 if (mine >= 0).any() else m0
    sizes = batch.grid_thw_M3.prod(-1).tolist()
    p0, p1 = sum(sizes[:m0]), sum(sizes[:m1])
    rows = {f: getattr(batch, f)[lo:hi] for f in ("tokens_BS", "labels_BS", "doc_ids_BS", "span_ids_BS",
                                                  "modality_BS", "task_BS")}
    return replace(batch, **rows, pos_ids_3BS=batch.pos_ids_3BS[:, lo:hi],
                   media_ids_BS=torch.where(mine >= 0, mine - m0, mine), patches_NP=batch.patches_NP[p0:p1],
                   grid_thw_M3=batch.grid_thw_M3[m0:m1], media_kind_M=batch.media_kind_M[m0:m1])


def parity_worker(config: str, out: str, steps: int = 10) -> None:
    """Train `steps` steps on the same global batches (read in one process, split by rows)."""
    from mmtrain.config import load_config
    from mmtrain.data_pipelines.loader import build_loader
    from mmtrain.distributed import exit_now, init_distributed, shutdown
    from mmtrain.run_config import RunConfig
    from mmtrain.trainer import Trainer

    cfg = load_config(RunConfig, config)
    env = init_distributed(cfg.dist, "cpu")
    trainer = Trainer(cfg, verbose=False, env=env)
    it = iter(build_loader(cfg.data, trainer.tokenizer, "train"))
    accum = cfg.train.grad_accum
    dims = trainer.dims  # the rows of this rank's data-parallel slot
    mine = [split_rows(next(it), dims.dp_rank, dims.dp_size) for _ in range(steps * accum)]
    stats = [trainer.train_step(iter(mine[i * accum:(i + 1) * accum])) for i in range(steps)]
    if env.is_main:
        Path(out).write_text(json.dumps({"loss": [s.loss for s in stats],
                                         "grad_norm": [s.grad_norm for s in stats],
                                         "tokens": [s.tokens for s in stats],
                                         "traffic": trainer.traffic.sent}))  # all steps (no fit)
    if env.distributed:
        shutdown()
        exit_now(0)


@pytest.mark.parametrize("variant", [
    ["dist.strategy=fsdp"],
    ["dist.strategy=ddp", "train.grad_accum=2"],  # no_sync on the first micro-batch
    ["dist.strategy=fsdp", "train.grad_accum=2", "dist.activation_checkpointing=true",
     "dist.reshard_after_forward=false"],
    # GradNorm's weights come from all-reduced head gradients: the same as one process's
    ["dist.strategy=fsdp", "train.grad_accum=2", "loss.balancer.kind=gradnorm", "loss.balancer.lr=0.5"],
], ids=["fsdp", "ddp-accum", "fsdp-accum-ac-zero2", "fsdp-gradnorm"])
def test_two_ranks_match_one_process_on_the_same_global_batch(make_raw, tmp_path, variant):
    """FSDP2 (or DDP) over 2 ranks holding half the rows each = one process holding all of them."""
    config = write_config(make_raw, tmp_path / "run", ["data.batch_size=4", *variant])
    launch([str(HERE), "parity", str(config), str(tmp_path / "one.json")])
    launch([str(HERE), "parity", str(config), str(tmp_path / "two.json")], nproc=2)
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert one["tokens"] == two["tokens"]
    assert one["loss"][0] == pytest.approx(two["loss"][0], rel=1e-6, abs=0)  # same weights, same data
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=0)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4, abs=0)
    assert one["loss"][-1] < one["loss"][1]  # (step 1 lacks a task: totals differ in kind)


MESHES = {  # 4 ranks: same world, other meshes
    "fsdp4": ["dist.strategy=fsdp"],
    "hsdp2x2": ["dist.strategy=fsdp", "dist.dp_replicate=2"],
    "fsdp4-ep2": ["dist.strategy=fsdp", "dist.ep=2"],
    "ep4": ["dist.strategy=fsdp", "dist.ep=4"],
    "hsdp2x2-ep2-ac": ["dist.strategy=fsdp", "dist.dp_replicate=2", "dist.ep=2",
                       "dist.activation_checkpointing=true", "train.grad_accum=2"],
    "ddp4": ["dist.strategy=ddp"],
}


@pytest.fixture(scope="module")
def one_process_four_rows(raw_for, tmp_path_factory):
    """One process on the rows that 4 ranks split between them (6 steps)."""
    out = tmp_path_factory.mktemp("mesh")
    results = {}
    for accum in (1, 2):
        overrides = ["data.batch_size=4", f"train.grad_accum={accum}"]
        config = write_config(raw_for, out / f"run{accum}", overrides)
        launch([str(HERE), "parity", str(config), str(out / f"one{accum}.json"), "6"])
        results[accum] = json.loads((out / f"one{accum}.json").read_text())
    return results


@pytest.mark.parametrize("mesh", list(MESHES))
def test_four_ranks_at_any_mesh_match_one_process(raw_for, one_process_four_rows, tmp_path, mesh):
    """FSDP, HSDP, FSDP + EP, EP over all ranks, DDP: same rows, same losses and grad norms."""
    overrides = ["data.batch_size=4", *MESHES[mesh]]
    config = write_config(raw_for, tmp_path / "run", overrides)
    launch([str(HERE), "parity", str(config), str(tmp_path / "four.json"), "6"], nproc=4)
    four = json.loads((tmp_path / "four.json").read_text())
    one = one_process_four_rows[2 if "train.grad_accum=2" in overrides else 1]
    assert four["tokens"] == one["tokens"]
    assert four["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=0)
    assert four["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5, abs=0)
    if "ep" in mesh:  # rows did travel, and were counted
        assert four["traffic"]["ep_all_to_all"] > 0


def test_two_ranks_run_diagnostics_reliance_guard_and_visual_ssl(make_raw, tmp_path):
    """Diagnostics are collective under FSDP (every rank joins, sums are all-reduced): both ranks
    see the same gaps, so the reliance guard moves the weights identically on each."""
    run = tmp_path / "run"
    config = write_config(make_raw, run, [
        "train.steps=4", "train.ckpt_every=0", "diagnostics.every=2", "diagnostics.batches=1",
        "diagnostics.warmup_steps=0", "loss.balancer.kind=reliance_guard", "model.vision.ssl_head=true",
        "loss.visual_ssl.weight=0.5", "captions.images=2", "captions.videos=1"])
    train(config, 2)
    diags = [json.loads(line) for line in (run / "diagnostics.jsonl").read_text().splitlines()]
    assert [d["step"] for d in diags] == [0, 2, 4]
    assert all(set(d["reliance_gap"]) <= {"image_text", "video_text"} for d in diags)
    recs = step_records(run)
    assert all(r["visual_ssl"] is not None for r in recs.values())
    summary = json.loads((run / "summary.json").read_text())
    weights = summary["weights"]
    assert weights["text"] == 1.0 and max(weights.values()) > 1.0  # an untrained model: gaps ~0
    # captioning under FSDP: every rank decodes its share from an unsharded replica, counts all-reduced
    assert summary["end"]["captions"]["prompts"] == 3 and summary["end"]["captions"]["words"]["colour"] > 0


# ----- kill and resume ---------------------------------------------------------------------------
def test_kill_and_resume_one_process_is_exact(make_raw, tmp_path):
    ref = tmp_path / "ref"
    train(write_config(make_raw, ref))
    run = tmp_path / "run"
    config = write_config(make_raw, run)
    # killed between checkpoints (after step 5; step_2 and step_4 exist)
    assert train(config, 1, "train.faults.kill_at_step=5", check=False).returncode == -9
    assert checkpoint_names(run) == ["step_2", "step_4"]
    # resumed from step_4, killed while writing step_6: the half-written save stays hidden
    assert train(config, 1, "train.faults.kill_in_save_at_step=6", check=False).returncode == -9
    assert checkpoint_names(run) == [".step_6.tmp", "step_2", "step_4"]
    train(config)  # resumes from step_4 again and finishes
    assert losses(run) == losses(ref)  # bit-identical per-step losses
    assert checkpoint_names(run) == ["step_2", "step_4", "step_6", "step_8"]
    log = (run / "train.log").read_text()
    assert log.count(f"resumed from {run / 'step_4'} at step 4") == 2


@pytest.fixture(scope="module")
def two_rank_reference(tmp_path_factory, raw_for):
    """An uninterrupted 2-rank FSDP run; rank 1 alone sees a NaN loss at step 3."""
    ref = tmp_path_factory.mktemp("two_rank") / "ref"
    config = write_config(raw_for, ref, ["train.faults.nan_at_step=3", "train.faults.rank=1"])
    train(config, 2)
    return ref, config


def test_two_ranks_agree_to_skip_a_nan_step(two_rank_reference):
    ref, _ = two_rank_reference
    recs = step_records(ref)
    assert [s for s, r in recs.items() if r["skipped"]] == [3]
    assert json.loads((ref / "summary.json").read_text())["skipped_steps"] == 1
    for log in ("train.log", "train.rank1.log"):  # both ranks skipped the update
        assert "step 3: non-finite loss or gradient, update skipped" in (ref / log).read_text()
    assert all(torch.isfinite(torch.tensor(r["loss"])) for s, r in recs.items() if s != 3)


def test_kill_and_resume_two_ranks_is_exact(two_rank_reference, tmp_path):
    """Rank 1 is SIGKILLed while the step-6 checkpoint is half written; torchrun restarts the job,
    which resumes from step_4 by itself and reproduces the uninterrupted run bit for bit."""
    ref, ref_config = two_rank_reference
    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**yaml.safe_load(ref_config.read_text()), "run_dir": str(run)}))
    train(config, 2, "train.faults.kill_in_save_at_step=6", max_restarts=1)
    assert losses(run) == losses(ref)
    log = (run / "train.log").read_text()
    assert f"resumed from {run / 'step_4'} at step 4" in log
    assert checkpoint_names(run) == ["step_2", "step_4", "step_6", "step_8"]


# ----- resharding --------------------------------------------------------------------------------
def test_saved_at_two_ranks_loads_in_one_process_and_continues(two_rank_reference, make_config, tmp_path):
    from mmtrain.checkpoint import load_for_inference
    from mmtrain.trainer import Trainer

    ref, _ = two_rank_reference
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(ref / "step_4", run / "step_4")
    cfg = make_config(run, [*RUN_OVERRIDES, "train.steps=6", "train.threads=0"])
    trainer = Trainer(cfg, verbose=False)
    assert trainer.resumed_from == run / "step_4" and trainer.step == 4
    assert "world size changed 2 -> 1" in trainer.resume_note
    _, saved, _ = load_for_inference(ref / "step_4")
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    assert all(int(s["step"]) == 3 for s in trainer.optimizer.state_dict()["state"].values())  # 1 skip
    ledger = trainer.train_loader.state_dict()["ledger"]
    assert isinstance(ledger["entries"], list)
    summary = trainer.fit()
    assert summary["steps"] == 6 and summary["world_size"] == 1
    last = step_records(run)
    assert sorted(last) == [5, 6] and all(not r["skipped"] for r in last.values())


def test_saved_in_one_process_loads_at_two_ranks(make_raw, tmp_path):
    run = tmp_path / "run"
    config = write_config(make_raw, run, ["train.steps=2"])
    train(config)
    train(config, 2, "train.steps=4")
    assert "world size changed 1 -> 2" in (run / "train.log").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["world_size"] == 2
    assert sorted(step_records(run)) == [1, 2, 3, 4]


if __name__ == "__main__":
    if sys.argv[1] == "parity":
        parity_worker(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:5]))
