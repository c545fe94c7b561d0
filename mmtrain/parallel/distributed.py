"""The process group under torchrun: which rank and device this process is, and the few
collectives the trainer needs (each a no-op in a single process).

torchrun (or `accelerate launch --multi_gpu`, which runs torchrun) sets RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT;
a plain `python -m mmtrain.train` sets none of them and runs as one process with no process
group at all (the fast path: no wrappers, no collectives).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from mmtrain.errors import UserError
from mmtrain.parallel import calls
from mmtrain.parallel.config import DistConfig


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_from_torchrun() -> DistEnv:
    """What torchrun told this process (a single process when the variables are absent)."""
    get = lambda name, default: int(os.environ.get(name, default))  # noqa: E731
    world = get("WORLD_SIZE", 1)
    return DistEnv(get("RANK", 0), world, get("LOCAL_RANK", 0), get("LOCAL_WORLD_SIZE", world))


def current_env() -> DistEnv:
    """The process group already set up in this process, else a single process."""
    if dist.is_available() and dist.is_initialized():
        local = env_from_torchrun()
        return DistEnv(dist.get_rank(), dist.get_world_size(), local.local_rank, local.local_world_size)
    return DistEnv()


def restart_count() -> int:
    """How often torchrun restarted this job (--max-restarts); 0 in the first launch."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def pick_device(name: str, env: DistEnv) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device: cuda requested but no CUDA device is available")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if env.local_rank >= torch.cuda.device_count():
            raise UserError(f"LOCAL_RANK {env.local_rank}: only {torch.cuda.device_count()} CUDA devices "
                            "(--nproc-per-node must not exceed the GPUs per node)")
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device(name)


def init_distributed(cfg: DistConfig, device_name: str) -> DistEnv:
    """Join the process group when launched by torchrun with WORLD_SIZE > 1.

    The timeout bounds every collective: a rank that died or hangs makes the others raise
    instead of waiting forever (NCCL aborts its communicators; torchrun then ends the job or
    restarts it with --max-restarts).
    """
    env = env_from_torchrun()
    if not env.distributed or dist.is_initialized():
        return current_env()
    device = pick_device(device_name, env)
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise UserError("dist.backend: nccl needs CUDA devices (use gloo on CPU)")
    timeout = timedelta(seconds=cfg.timeout_s)
    calls.install(timeout)  # a collective that times out names itself, its group and its call site
    dist.init_process_group(backend, store=_attempt_store(env, timeout), rank=env.rank,
                            world_size=env.world_size, timeout=timeout,
                            device_id=device if backend == "nccl" else None)
    return current_env()


def _attempt_store(env: DistEnv, timeout: timedelta) -> dist.Store:
    """The rendezvous store of env://, with keys private to this torchrun attempt.

    After a restart (--max-restarts) torchrun's workers reconnect to the agent's store, which still
    holds the previous attempt's keys: gloo (and NCCL's bootstrap) could then read a dead peer's
    address and fail with "Connection refused" or hang. A per-attempt prefix keeps them apart.
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as e:
        raise UserError(f"{e.args[0]} is not set: launch with torchrun (see docs/DISTRIBUTED.md)") from None
    store = dist.TCPStore(addr, port, env.world_size, is_master=not agent_store and env.rank == 0,
                          timeout=timeout, multi_tenant=not agent_store)
    return dist.PrefixStore(f"mmtrain/attempt_{restart_count()}", store)


def shutdown() -> None:
    """Leave the process group together: a rank tearing down gloo while a peer is still talking
    to it can abort the peer at exit (and a non-zero exit makes torchrun restart the job)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def exit_now(code: int) -> NoReturn:
    """End a torchrun worker at once (after `shutdown()` on success), skipping interpreter teardown.

    At teardown gloo's C++ threads race Python's finalisation and now and then abort or segfault
    the process ("terminate called without an active exception"), which turns a finished run
    into a failed one for torchrun (and a restart with --max-restarts).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def all_reduce(t: torch.Tensor, env: DistEnv, op: str = "sum") -> torch.Tensor:
    """In place across ranks (sum or max); returns `t` for chaining."""
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


def broadcast_object(obj: Any, env: DistEnv, src: int = 0) -> Any:
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()
