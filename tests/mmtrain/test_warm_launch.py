"""The warm launcher (warm_launch.py) against what it stands in for: a rank forked from the warm
parent sees what torchrun's rank sees (variables, argv, sys.path[0], working directory, session),
a SIGKILL is real (-9), a failed rank ends the group at once, a timeout kills the whole session.

Run as a script, the file is the worker: `... test_warm_launch.py MODE OUT`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
TORCHRUN_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS")


def _worker(mode: str, out: str) -> None:
    import torch.distributed as dist

    from mmtrain.parallel.config import DistConfig
    from mmtrain.parallel.distributed import exit_now, init_distributed, shutdown

    env = init_distributed(DistConfig(timeout_s=30), "cpu")
    rank = env.rank
    if mode == "env":
        t = __import__("torch").ones(1)
        dist.all_reduce(t)
        Path(f"{out}.{rank}").write_text(json.dumps({
            "env": {k: os.environ.get(k) for k in TORCHRUN_KEYS}, "argv": sys.argv[1:],
            "argv0": Path(sys.argv[0]).name, "path0": sys.path[0], "cwd": os.getcwd(),
            "own_session": os.getsid(0) == os.getpid(), "sum": t.item(), "name": __name__,
            "threads": __import__("torch").get_num_threads(),
            "forked": "warm_launch" in sys.modules}))  # preloaded by the warm parent only
    elif mode == "kill":  # rank 1 dies; rank 0 waits in a collective that will never complete
        if rank == 1 or env.world_size == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()
    elif mode == "sleep":  # a child in the rank's session must go with it
        import subprocess

        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        Path(f"{out}.{rank}").write_text(str(child.pid))
        time.sleep(600)
    shutdown()
    exit_now(0)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # a zombie is dead too


@pytest.mark.distributed
def test_a_forked_rank_sees_what_a_torchrun_rank_sees(tmp_path, monkeypatch):
    from dist_runs import launch

    seen = {}
    for how in ("warm", "cold"):
        monkeypatch.setenv("MMTRAIN_COLD_LAUNCH", "1" if how == "cold" else "0")
        launch([str(HERE), "env", str(tmp_path / how)], nproc=2, timeout=120)
        seen[how] = [json.loads((tmp_path / f"{how}.{r}").read_text()) for r in range(2)]
    for r in range(2):
        warm, cold = seen["warm"][r], seen["cold"][r]
        assert warm.pop("forked") and not cold.pop("forked")  # each path was the one asked for
        assert warm["argv"][-1].endswith("warm") and cold["argv"][-1].endswith("cold")
        warm["argv"][-1] = cold["argv"][-1] = "OUT"
        differ = {k: (warm[k], v) for k, v in cold.items() if k != "env" and warm[k] != v}
        differ |= {k: (warm["env"][k], v) for k, v in cold["env"].items() if warm["env"][k] != v}
        assert not differ, differ
    assert seen["warm"][1]["env"]["RANK"] == "1" and seen["warm"][0]["sum"] == 2.0


@pytest.mark.distributed
def test_a_killed_rank_is_minus_nine_and_ends_the_group_at_once(tmp_path):
    import warm_launch

    env = {**os.environ, **warm_launch.IMPORT_TIME_ENV}
    t0 = time.monotonic()
    code, _, err = warm_launch.run([str(HERE), "kill", str(tmp_path / "o")], 2, env, REPO, timeout=60)
    assert code == 1 and "rank 1 (local_rank 1) exitcode -9" in err, err[-2000:]
    assert time.monotonic() - t0 < 30  # rank 0 was stopped, not left to its 30 s collective timeout
    code, _, _ = warm_launch.run([str(HERE), "kill", str(tmp_path / "p")], 1, env, REPO, timeout=60)
    assert code == -9  # one process: its own exit code, as `python` gives it


@pytest.mark.distributed
def test_a_timeout_kills_every_rank_and_its_children(tmp_path):
    import warm_launch

    env = {**os.environ, **warm_launch.IMPORT_TIME_ENV}
    with pytest.raises(TimeoutError):
        warm_launch.run([str(HERE), "sleep", str(tmp_path / "c")], 2, env, REPO, timeout=5)
    children = [int((tmp_path / f"c.{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + 10
    while not all(map(_gone, children)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(map(_gone, children)), children


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
