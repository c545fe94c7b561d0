"""`accelerate launch -m mmtrain.train CONFIG` is another way to start the torchrun-style job: two CPU
ranks (gloo) launched by accelerate train exactly as two launched by torchrun.

accelerate's `--multi_gpu` picks its torchrun launcher (which sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT and needs no GPU); its `--cpu` would start one process (multi-CPU goes
through mpirun and a hostfile instead), so that flag is not used (README, docs/DISTRIBUTED.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mmtrain.config import apply_override

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = ["dist.timeout_s=60", "train.threads=1", "train.eval_batches=1", "train.log_every=1",
             "train.steps=3", "train.ckpt_every=0", "data.batch_size=4"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu",
              "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "--main_process_port", "0", "-m", "mmtrain.train"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "--max-restarts=0", "-m", "mmtrain.train"]


def _run(launcher: list[str], make_raw, run_dir: Path) -> list[dict]:
    raw = make_raw(run_dir)
    for item in OVERRIDES:
        apply_override(raw, item)
    config = run_dir.parent / f"{run_dir.name}.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([*launcher, str(config), "--quiet"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    assert (run_dir / "train.rank1.log").is_file() and (run_dir / "step_3").is_dir()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "eval" not in json.loads(line)]


def test_accelerate_launch_trains_like_torchrun(make_raw, tmp_path):
    by_accelerate = _run(ACCELERATE, make_raw, tmp_path / "accelerate")
    by_torchrun = _run(TORCHRUN, make_raw, tmp_path / "torchrun")
    assert [r["step"] for r in by_accelerate] == [1, 2, 3]
    same = [(r["loss"], r["tokens"]) for r in by_torchrun]
    assert [(r["loss"], r["tokens"]) for r in by_accelerate] == same
