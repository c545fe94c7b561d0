"""Rank processes forked from a warm parent: torchrun's environment without torchrun's start-up.

`python -m torch.distributed.run --nproc-per-node N` costs an agent interpreter and N rank
interpreters, each importing torch and mmtrain from cold (~2 CPU-s each, docs/CONVENTIONS.md).
Here a forkserver, started once per pytest process, imports them once (one thread, no torch op
run, so nothing but the interpreter is forked mid-use). Each rank is forked from it and

- is its own OS process in its own session (as torchrun's workers are), with its own gloo
  connections: SIGKILL kills it for real and its exit code is -9;
- gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT,
  TORCHELASTIC_RESTART_COUNT, ...) and, as torchrun's agent does, a rendezvous store the launcher
  hosts (TORCHELASTIC_USE_AGENT_STORE=True): it listens before any rank starts, on a port the
  kernel gave it, so no rank races another to bind or to connect;
- runs `-m module` or a script as `__main__` with `sys.argv`, `sys.path[0]`, the working
  directory and the environment the command line would give it, and its atexit handlers at exit.

The group behaves as torchrun's does without restarts: when a rank fails the others get SIGTERM
(then SIGKILL), the exit code is 1 if any rank failed (one process: its own code), and stdout and
stderr are every rank's, in rank order. Real torchrun stays where a test is about torchrun itself:
restarts (`--max-restarts`), the console script (`--no-python`), accelerate.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from functools import cache
from multiprocessing.connection import wait
from pathlib import Path

# imported by the warm parent before it forks: what a rank of the trainer or a test worker loads
PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint",
           "torch.distributed.pipelining", "torch._dynamo", "yaml", "mmtrain.train", "mmtrain.loop.trainer",
           "mmtrain.cli", "warm_launch"]
# read when a library loads (OpenMP's pool size), so the parent must already have them
IMPORT_TIME_ENV = {"OMP_NUM_THREADS": "1"}
GRACE_S = 5.0  # SIGTERM to SIGKILL for the ranks left when one fails (torchrun waits 30 s)
_REAL_RUN = subprocess.run  # before a test patches subprocess_run in
_START = threading.Lock()  # a tool's thread pool may launch its first two runs at once


@cache
def _context() -> mp.context.ForkServerContext:
    """The forkserver, started on first use with the import-time environment it must have."""
    with _START:
        return _start()


def _start() -> mp.context.ForkServerContext:
    from multiprocessing import forkserver
    from unittest import mock

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with mock.patch.dict(os.environ, IMPORT_TIME_ENV):  # the forkserver inherits os.environ
        forkserver.ensure_running()
    return ctx


def can_fork(env: dict) -> bool:
    """Whether a forked rank sees what an exec'd one would: the import-time variables agree."""
    return all(env.get(k) == v for k, v in IMPORT_TIME_ENV.items())


def agent_store(nproc: int):
    """The group's rendezvous store, listening already (torchrun's agent store: the ranks connect)."""
    import torch.distributed as dist

    return dist.TCPStore("localhost", 0, nproc, is_master=True, wait_for_workers=False)


def rank_env(env: dict, rank: int, nproc: int, port: int, torchrun: bool) -> dict:
    """torchrun's variables for `rank` of a one-node job with no restarts, on the agent's store."""
    if not torchrun:
        return dict(env)
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "localhost",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "warm", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def _rank_main(args: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    """In the forked rank: become `python ARGS` (ARGS: `-m MODULE ...` or `SCRIPT ...`)."""
    os.setsid()  # its own session, as torchrun's workers: a kill of the group takes its children too
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout.reconfigure(write_through=True)  # PYTHONUNBUFFERED: a killed rank's last lines are kept
    sys.stderr.reconfigure(write_through=True)
    os.environ.clear()
    os.environ.update(env)
    import torch.distributed as dist  # (preloaded)

    dist.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG is read at import: the parent's was not ours
    os.chdir(cwd)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the forkserver ignores SIGINT
    # the parent preloaded the module `-m` runs as __main__, which runpy warns of; a cold start would not
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package",
                            category=RuntimeWarning)
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path.insert(0, cwd)
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = str(Path(cwd, args[0]).resolve())
            sys.argv = [args[0], *args[1:]]
            sys.path.insert(0, str(Path(script).parent))
            runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # the forkserver's child ends in os._exit, which skips them


def _kill_session(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _stop(procs: list, grace: float) -> None:
    """SIGTERM to every live rank's session, SIGKILL to what is left after `grace` seconds."""
    procs = [p for p in procs if p.pid is not None]  # started
    live = [p for p in procs if p.exitcode is None]
    for p in live:
        _kill_session(p.pid, signal.SIGTERM)
    if live:  # (wait() on no object sleeps the whole timeout)
        wait([p.sentinel for p in live], timeout=grace)
    for p in procs:  # the sessions too: a rank's own children (loader workers) go with it
        _kill_session(p.pid, signal.SIGKILL)
        p.join()


def run(args: list[str], nproc: int, env: dict, cwd: Path, timeout: float, merge: bool = False,
        torchrun: bool | None = None):
    """`python ARGS` (nproc 1, unless `torchrun`) or a torchrun-like group of `nproc` forked ranks.
    Returns (exit code, stdout, stderr), or raises TimeoutError with the stderr so far.
    merge: stderr into stdout, interleaved as written (stderr is then "")."""
    ctx = _context()
    store = agent_store(nproc) if torchrun or nproc > 1 else None
    port = store.port if store is not None else 0
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        logs = [(f"{tmp}/out{r}", f"{tmp}/{'out' if merge else 'err'}{r}") for r in range(nproc)]
        procs = [ctx.Process(target=_rank_main, daemon=False, name=f"rank{r}",
                             args=(args, rank_env(env, r, nproc, port, torchrun or nproc > 1), str(cwd),
                                   *logs[r]))
                 for r in range(nproc)]
        first_failure = None
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            while first_failure is None:
                # one look at who is left: a rank that ends between two looks must not leave an empty
                # list to wait() on, which sleeps the whole timeout (seen: 180 s and 240 s "stalls")
                live = [p.sentinel for p in procs if p.exitcode is None]
                if not live:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    _stop(procs, 0.0)
                    raise TimeoutError(_read(logs, 1)[-4000:])
                wait(live, timeout=left)
                first_failure = next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), None)
        finally:
            _stop(procs, GRACE_S)
        out, err = _read(logs, 0), "" if merge else _read(logs, 1)
    del store  # the port closes with the group
    if not (torchrun or nproc > 1):
        return procs[0].exitcode, out, err
    if first_failure is None:
        return 0, out, err
    code = procs[first_failure].exitcode
    root = (f"warm_launch: root cause (first observed failure): rank {first_failure} "
            f"(local_rank {first_failure}) exitcode {code} (pid {procs[first_failure].pid})\n")
    return 1, out, err + root


def _read(logs: list, which: int) -> str:
    return "".join(Path(log[which]).read_text(errors="replace") if Path(log[which]).exists() else ""
                   for log in logs)


def command(cmd: list[str]) -> tuple[list[str], int, bool] | None:
    """(ARGS, nproc, torchrun) when `cmd` is `python ARGS` or `python -m torch.distributed.run --standalone
    --nproc-per-node N ARGS` without restarts; None for anything else (which runs as it is)."""
    if not cmd or cmd[0] != sys.executable or len(cmd) < 2 or cmd[1] in ("-c", "-"):
        return None
    if cmd[1:3] != ["-m", "torch.distributed.run"]:
        return (cmd[1:], 1, False) if cmd[1] != "-m" or len(cmd) > 2 else None
    rest, flags = cmd[3:], {}
    while rest and rest[0].startswith("--"):
        key, _, value = rest.pop(0).partition("=")
        if key != "--standalone":
            flags[key.replace("_", "-")] = value or rest.pop(0)
    nproc, restarts = flags.pop("--nproc-per-node", "1"), flags.pop("--max-restarts", "0")
    flags.pop("--monitor-interval", None)
    if flags or restarts != "0" or not nproc.isdigit() or not rest:
        return None
    return rest, int(nproc), True


def subprocess_run(cmd, *, stdout=None, stderr=None, capture_output=False, text=False, env=None, cwd=None,
                   timeout=None, check=False, **kw):
    """subprocess.run for a test to patch in: a Python or torchrun command runs forked from the warm
    parent (`command`); any other, or one whose environment the parent cannot give, runs as it is."""
    plain = isinstance(cmd, list | tuple) and set(kw) <= {"encoding", "errors"}
    parsed = command([str(c) for c in cmd]) if plain else None
    if parsed is None or not can_fork(os.environ if env is None else env):
        return _REAL_RUN(cmd, stdout=stdout, stderr=stderr, capture_output=capture_output, text=text, env=env,
                         cwd=cwd, timeout=timeout, check=check, **kw)
    merge = stderr == subprocess.STDOUT
    try:
        args, nproc, torchrun = parsed
        fork_env = dict(os.environ if env is None else env)
        code, out, err = run(args, nproc, fork_env, Path(cwd or os.getcwd()), timeout or 24 * 3600.0,
                             merge=merge, torchrun=torchrun)
    except TimeoutError:
        raise subprocess.TimeoutExpired(cmd, timeout) from None
    for handle, data in ((stdout, out), (stderr, err)):
        if hasattr(handle, "write"):
            handle.write(data if "b" not in getattr(handle, "mode", "") else data.encode())
            handle.flush()
    keep = capture_output or stdout == subprocess.PIPE
    as_type = (lambda x: x) if text or kw.get("encoding") else str.encode
    done = subprocess.CompletedProcess(cmd, code, as_type(out) if keep else None,
                                       as_type(err) if capture_output or stderr == subprocess.PIPE else None)
    if check:
        done.check_returncode()
    return done

