"""A checkpoint is a dict of named Stateful parts; this module names them and says where each lives.

Each part has `state_dict()` / `load_state_dict()` (torch's `Stateful`); save and load iterate
`Trainer.parts()` and never reach into the trainer. Three kinds:

    sharded     model, optim                               DCP (get/set_{model,optimizer}_state_dict)
    replicated  train, scheduler, balancer, callback.<n>   rank 0's state.pt (the same on every rank)
    per_rank    data, rng                                  rank_<r>.pt (loader position + ledger, RNG)

Load order: sharded, replicated (the trainer's order), per-rank (the curriculum rebuilds its loader
before `LoaderPart` loads into it). FORMAT 3: state.pt `{"format", "world_size", "config", <part>:
state, ...}`, rank_<r>.pt `{"rank", <part>: state, ...}`; `torch.load(..., weights_only=True)` reads
both. A missing `callback.*` part leaves it as built, any other missing part is an error, unclaimed
ones are ignored; format 2 is converted on read, format 1 loads in one process. At another world
size a per-rank part's `load_resharded` takes over (ARCHITECTURE, "Distributed training and checkpoints").
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful

from mmtrain.errors import UserError
from mmtrain.objectives.curriculum import stage_at
from mmtrain.parallel.distributed import DistEnv
from mmtrain.state.checkpoint import (
    DCP_DIR,
    Checkpointer,
    check_dcp_metadata,
    load_rank_state,
    load_state,
    quiet_single_process,
)
from mmtrain.state.layout import LAYOUT, check_trainable

FORMAT = 3  # 2: train counters and histories flat in state.pt; 1: everything in one state.pt
SHARED_META = ("format", "layout", "world_size", "dp_size", "config")  # state.pt keys, not parts
RANK_META = ("rank", "dp_rank")
OPTIONAL_PREFIX = "callback."  # parts that come and go with the user's code


@dataclass
class TrainState:
    """The loop's own counters and its eval history (a replicated part, `train`)."""

    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    evals: list[dict] = field(default_factory=list)  # {"step": N, ...EvalResult.to_dict()}

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            setattr(self, f.name, state[f.name])
        self.evals = list(self.evals)


class ModelPart:
    """The model's fully-qualified, possibly sharded state (DCP key `model`)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state)


class OptimizerPart:
    """The optimizer's state keyed by parameter name, not id (DCP key `optim`), so it reshards too."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state)


class LoaderPart:
    """The train loader's position and ledger (per rank). The loader is looked up at each call:
    the curriculum replaces it at stage boundaries and while loading."""

    def __init__(self, get_loader: Callable[[], Any]):
        self.get_loader = get_loader

    def state_dict(self) -> dict:
        return self.get_loader().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.get_loader().load_state_dict(state)

    def load_resharded(self, states: list[dict], rank: int) -> None:
        with warnings.catch_warnings():  # the resume note says it once, on rank 0
            warnings.simplefilter("ignore")
            self.get_loader().load_state_dict(merged_data_state(states, rank))


class RNGPart:
    """Python, NumPy, torch (and this rank's CUDA device's) RNG states of this process (per rank)."""

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state)


@dataclass
class Parts:
    """A checkpoint's parts by name, grouped by where they are stored (see the module docstring)."""

    sharded: dict[str, Stateful]
    replicated: dict[str, Stateful]
    per_rank: dict[str, Stateful]
    # (data-parallel rank, data-parallel size) of this rank: whose rows it reads. Under context
    # parallelism the ranks of a cp group share one; None: (rank, world size).
    data_rank: tuple[int, int] | None = None

    def __post_init__(self):
        clash = (set(self.replicated) & set(SHARED_META)) | (set(self.per_rank) & set(RANK_META))
        if clash:
            raise ValueError(f"checkpoint parts may not be named {sorted(clash)}")


# ----- save ------------------------------------------------------------------------------------
def save_checkpoint(checkpointer: Checkpointer, parts: Parts, step: int, config: dict, config_text: str,
                    files: dict[str, Path], before_commit: Callable[[], None] | None = None,
                    background: bool = False) -> Path | None:
    """Collective. DCP calls the sharded parts' state_dict itself (they are Stateful). `background`:
    staged now, written while training goes on, committed by `checkpointer.poll` (-> None)."""
    env = checkpointer.env
    dp_rank, dp_size = parts.data_rank or (env.rank, env.world_size)
    shared = {"format": FORMAT, "layout": LAYOUT, "world_size": env.world_size, "dp_size": dp_size,
              "config": config,
              **{name: part.state_dict() for name, part in parts.replicated.items()}}
    own = {"rank": env.rank, "dp_rank": dp_rank,
           **{name: part.state_dict() for name, part in parts.per_rank.items()}}
    save = checkpointer.save_async if background else checkpointer.save
    return save(step, dict(parts.sharded), shared, own, config_text, files, before_commit)


# ----- load ------------------------------------------------------------------------------------
def load_checkpoint(path: Path, parts: Parts, env: DistEnv) -> str | None:
    """Restore every part from the checkpoint at `path`; returns a note for the log, or None."""
    shared = load_state(path)
    fmt = shared.get("format", 1)
    if fmt > FORMAT:
        raise UserError(f"{path}: checkpoint format {fmt} is newer than this code reads ({FORMAT})")
    check_trainable(path, shared)  # the fused weights' row layout (state/layout.py)
    if fmt == 1:
        return _load_format_1(path, parts, shared, env)
    shared = from_format_2(shared) if fmt == 2 else shared
    _load_sharded(path, parts.sharded, env)
    notes = load_parts(path, parts.replicated, shared, SHARED_META)
    saved = (shared["world_size"], shared.get("dp_size", shared["world_size"]))
    notes += _load_per_rank(path, parts.per_rank, saved, parts.data_rank or (env.rank, env.world_size), env)
    return "; ".join(notes) or None


def load_parts(path: Path, parts: dict[str, Stateful], saved: dict, meta: tuple[str, ...]) -> list[str]:
    """Load each part from `saved[name]`, in order; -> notes on optional parts missing and unclaimed ones."""
    notes = []
    for name, part in parts.items():
        if name in saved:
            part.load_state_dict(saved[name])
        elif name.startswith(OPTIONAL_PREFIX):
            notes.append(f"{name} is not in the checkpoint: it starts fresh")
        else:
            raise UserError(f"{path}: checkpoint has no part {name!r}")
    unclaimed = sorted(set(saved) - set(parts) - set(meta))
    return notes + [f"checkpoint part {name} has no owner in this run: ignored" for name in unclaimed]


def _load_sharded(path: Path, parts: dict[str, Stateful], env: DistEnv) -> None:
    import torch.distributed.checkpoint as dcp

    check_dcp_metadata(path / DCP_DIR)
    with quiet_single_process():  # DCP loads each Stateful in place, then calls its load_state_dict
        dcp.load(dict(parts), checkpoint_id=path / DCP_DIR, no_dist=not env.distributed)


def _load_per_rank(path: Path, parts: dict[str, Stateful], saved: tuple[int, int], data_rank: tuple[int, int],
                   env: DistEnv) -> list[str]:
    """`saved`, `data_rank`: (world size, data-parallel size) saved, (dp rank, dp size) now."""
    (saved_world, saved_dp), (dp_rank, dp_size) = saved, data_rank
    if saved_world == env.world_size and saved_dp == dp_size:  # the same ranks read the same rows
        own = load_rank_state(path, env.rank)
        if own is None:
            raise UserError(f"{path}: no data state for rank {env.rank}")
        return load_parts(path, parts, own, RANK_META)
    ranks = [load_rank_state(path, r) for r in range(saved_world)]
    if any(r is None for r in ranks):
        raise UserError(f"{path}: data state of some of its {saved_world} ranks is missing")
    slots: dict[int, dict] = {}  # one state per saved data-parallel slot (a cp group's ranks: one)
    for r in ranks:
        slots.setdefault(r.get("dp_rank", r["rank"]), r)
    by_slot = [slots[k] for k in sorted(slots)]
    for name, part in parts.items():
        if hasattr(part, "load_resharded"):  # the data position
            if saved_dp == dp_size:
                part.load_state_dict(by_slot[dp_rank][name])
            else:
                part.load_resharded([r[name] for r in by_slot if name in r], dp_rank)
        elif env.rank < len(ranks) and name in ranks[env.rank]:
            part.load_state_dict(ranks[env.rank][name])
    if saved_dp == dp_size:
        return [f"world size changed {saved_world} -> {env.world_size} with the same {dp_size} data-parallel "
                "slots: the data position resumes exactly"]
    return [f"world size changed {saved_world} -> {env.world_size}: exact data resume is impossible; "
            "every source restarts at its next epoch (model, optimizer and counters resume exactly)"
            if saved_world != env.world_size else
            f"data-parallel size changed {saved_dp} -> {dp_size}: exact data resume is impossible; "
            "every source restarts at its next epoch (model, optimizer and counters resume exactly)"]


def merged_data_state(states: list[dict], rank: int) -> dict:
    """One loader state from all saved ranks: the workers' cursors of every rank (so that the
    loader restarts past everything any rank read) and, for rank 0, every rank's ledger."""
    merged = dict(states[0])
    merged["workers"] = [w for s in states for w in s["workers"]]
    entries, counts = [], {}
    if rank == 0:
        for s in states:
            entries += s["ledger"]["entries"]
            for reason, n in s["ledger"]["counts"].items():
                counts[reason] = counts.get(reason, 0) + n
    merged["ledger"] = {"entries": entries, "counts": counts}
    return merged


# ----- older formats ---------------------------------------------------------------------------
def from_format_2(shared: dict) -> dict:
    """Format 2's state.pt as format 3 parts. It had no curriculum part: the stage is the one the
    saved config's train.stages give for the saved step (what the trainer then derived)."""
    out = {k: shared[k] for k in ("world_size", "config", "scheduler", "balancer")}
    out["format"] = FORMAT
    out["train"] = {f.name: shared[f.name] for f in fields(TrainState)}
    if shared.get("diagnostics"):
        out["callback.diagnostics"] = {"history": shared["diagnostics"]}
    stages = shared["config"]["train"].get("stages") or []
    if stages:
        out["callback.curriculum"] = {"stage": stage_at([s["until_step"] for s in stages], shared["step"])}
    return out


def _load_format_1(path: Path, parts: Parts, state: dict, env: DistEnv) -> str:
    """One state.pt with plain (unsharded, id-keyed) model and optimizer state dicts."""
    if env.distributed:
        raise UserError("this checkpoint has the old single-file format: resume it in one process")
    model, optim = parts.sharded["model"], parts.sharded["optim"]
    model.model.load_state_dict(state["model"])
    optim.optimizer.load_state_dict(state["optimizer"])
    v2 = {**state, "world_size": 1, "consecutive_skips": 0, "config": state.get("config", {"train": {}})}
    notes = load_parts(path, parts.replicated, from_format_2(v2), SHARED_META)
    load_parts(path, parts.per_rank, {"data": state["data"], "rng": state["rng"]}, RANK_META)
    return "; ".join(["resumed from a single-file (format 1) checkpoint", *notes])


# ----- RNG ---------------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Tensors, lists and ints only, so that it loads with torch.load(weights_only=True).

    CUDA: this rank's device only (pick_device made it current). Every visible device's state
    would make each rank initialise a context on every GPU of the node, and restoring them would
    overwrite the generators other ranks own."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda_device"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]  # format-1 checkpoints hold an array here: the same either way
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if not torch.cuda.is_available():
        return
    dev = torch.cuda.current_device()
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"], dev)
    elif dev < len(state.get("cuda", [])):  # older checkpoints: every visible device's, ours at dev
        torch.cuda.set_rng_state(state["cuda"][dev], dev)
