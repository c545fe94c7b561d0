"""Two gloo ranks, each with its own train loader (2 workers): a data failure on one rank stops
both together with the same message, within seconds (not the collective timeout); a failing
shard is skipped and counted by the rank that reads it while both go on.

This file is also the rank process: `python test_ranks.py RANK PORT SPEC_JSON OUT`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]
COLLECTIVE_TIMEOUT_S = 60


def rank_main(rank: int, port: int, spec_file: str, out: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    sys.path.insert(0, str(HERE.parent))
    from dp_shards import data_cfg

    from mmtrain.data_pipelines.errors import DataError
    from mmtrain.data_pipelines.loader import build_loader
    from mmtrain.data_pipelines.tokenizer import ByteTokenizer

    spec = json.loads(Path(spec_file).read_text())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    cfg = data_cfg(train=spec["shards"], num_workers=2, shard_retries=1, retry_backoff_s=0.0)
    loader = build_loader(cfg, ByteTokenizer(), "train", rank, 2)
    result, t0 = {"batches": 0, "error": None}, time.monotonic()
    try:
        for _, _ in zip(range(spec["batches"]), loader):
            result["batches"] += 1
            dist.barrier()  # what a training step's collectives do: wait for the other rank
    except DataError as e:
        result["error"] = str(e)
    result["seconds"] = time.monotonic() - t0
    result["ledger"] = [list(e) for e in loader.ledger.entries]
    Path(out).write_text(json.dumps(result))
    os._exit(0)  # no gloo teardown race at exit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path, shards: list[str], batches: int) -> list[dict]:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"shards": shards, "batches": batches}))
    port, env = _free_port(), {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [[sys.executable, str(HERE), str(r), str(port), str(spec), str(tmp_path / f"r{r}.json")]
            for r in range(2)]
    procs = [subprocess.Popen(a, env=env, stderr=subprocess.PIPE, text=True) for a in args]
    for p in procs:
        _, err = p.communicate(timeout=100)
        assert p.returncode == 0, err[-3000:]
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]


def test_a_failure_on_one_rank_stops_both_with_the_same_message(tmp_path):
    from dp_shards import text_shards

    url = text_shards(tmp_path, 1, 3)[0]  # 3 samples for 2 ranks x 2 workers: rank 1 worker 1 owns none
    r0, r1 = run_ranks(tmp_path, [url], batches=50)
    assert r0["error"] == r1["error"] and r0["error"].startswith("rank 1: ")
    assert "without a sample it owns" in r0["error"]
    assert max(r0["seconds"], r1["seconds"]) < COLLECTIVE_TIMEOUT_S / 4


def test_a_failing_shard_is_skipped_by_the_rank_that_reads_it(tmp_path):
    from dp_shards import text_shards

    urls = text_shards(tmp_path, 4, 5)
    bad = f"pipe:cat {urls[0]} | head -c 700; exit 2"
    r0, r1 = run_ranks(tmp_path, [*urls, bad], batches=12)
    assert r0["error"] is None and r1["error"] is None
    assert r0["batches"] == r1["batches"] == 12
    failed = [e for e in r0["ledger"] + r1["ledger"] if e[0] == bad]
    assert {tuple(e) for e in failed} == {(bad, "", "open_failed")}


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
