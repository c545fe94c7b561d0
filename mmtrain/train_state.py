"""What a checkpoint holds of a Trainer, and how it comes back (at the same or another world size).

Model and optimizer go through `torch.distributed.checkpoint.state_dict.get_state_dict` /
`set_state_dict` (fully-qualified names, sharded DTensors under FSDP2), so DCP reshards them on
load. Everything replicated (counters, scheduler, balancer, eval history) is rank 0's state.pt;
what differs per rank (data-loader position with its corrupt-sample ledger, RNG states) is one
small file per rank.

At another world size the data position cannot be resumed exactly (each rank reads another
share of the shards): every source restarts at its next epoch past what any rank had read, and
rank 0 inherits the union of the ledgers. The trainer says so in its log.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import torch

from mmtrain.checkpoint import DCP_DIR, check_dcp_metadata, load_rank_state, load_state, quiet_single_process
from mmtrain.config import to_dict
from mmtrain.errors import UserError

FORMAT = 2  # 1: everything in one torch.save'd state.pt (read for resume in one process)


def model_optim_state(trainer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    return {"model": model_sd, "optim": optim_sd}


def shared_state(trainer) -> dict:
    return {
        "format": FORMAT,
        "scheduler": trainer.scheduler.state_dict(),
        "balancer": trainer.balancer.state_dict(),
        "step": trainer.step,
        "tokens_seen": trainer.tokens_seen,
        "skipped_steps": trainer.skipped_steps,
        "consecutive_skips": trainer.consecutive_skips,
        "evals": trainer.evals,
        "diagnostics": trainer.diagnostics,
        "world_size": trainer.env.world_size,
        "config": to_dict(trainer.cfg),
    }


def rank_state(trainer) -> dict:
    return {"rank": trainer.env.rank, "data": trainer.train_loader.state_dict(), "rng": rng_state()}


def load_training_state(trainer, path: Path) -> str | None:
    """Restore `trainer` from the checkpoint at `path`; returns a note for the log or None."""
    shared = load_state(path)
    if shared.get("format", 1) < FORMAT:
        return _load_single_file(trainer, shared)
    _load_model_optim(trainer, path)
    trainer.scheduler.load_state_dict(shared["scheduler"])
    trainer.balancer.load_state_dict(shared["balancer"])
    trainer.step = shared["step"]
    trainer.tokens_seen = shared["tokens_seen"]
    trainer.skipped_steps = shared["skipped_steps"]
    trainer.consecutive_skips = shared["consecutive_skips"]
    trainer.evals = list(shared["evals"])
    trainer.diagnostics = list(shared.get("diagnostics", []))
    trainer.enter_stage(trainer.stage_at(trainer.step))  # the data state below is that stage's loader's
    env, saved_world = trainer.env, shared["world_size"]
    if saved_world == env.world_size:
        own = load_rank_state(path, env.rank)
        if own is None:
            raise UserError(f"{path}: no data state for rank {env.rank}")
        trainer.train_loader.load_state_dict(own["data"])
        set_rng_state(own["rng"])
        return None
    ranks = [load_rank_state(path, r) for r in range(saved_world)]
    if any(r is None for r in ranks):
        raise UserError(f"{path}: data state of some of its {saved_world} ranks is missing")
    with warnings.catch_warnings():  # the note below says it once, on rank 0
        warnings.simplefilter("ignore")
        trainer.train_loader.load_state_dict(merged_data_state([r["data"] for r in ranks], env.rank))
    if env.rank < saved_world:
        set_rng_state(ranks[env.rank]["rng"])
    return (f"world size changed {saved_world} -> {env.world_size}: exact data resume is impossible; "
            "every source restarts at its next epoch (model, optimizer and counters resume exactly)")


def _load_model_optim(trainer, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = model_optim_state(trainer)
    check_dcp_metadata(path / DCP_DIR)
    with quiet_single_process():
        dcp.load(state, checkpoint_id=path / DCP_DIR, no_dist=not trainer.env.distributed)
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


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


def _load_single_file(trainer, state: dict) -> str:
    """A checkpoint of the single-process format (model and optimizer inside state.pt)."""
    if trainer.env.distributed:
        raise UserError("this checkpoint has the old single-file format: resume it in one process")
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.balancer.load_state_dict(state["balancer"])
    trainer.train_loader.load_state_dict(state["data"])
    set_rng_state(state["rng"])
    trainer.step = state["step"]
    trainer.tokens_seen = state["tokens_seen"]
    trainer.skipped_steps = state["skipped_steps"]
    trainer.evals = list(state["evals"])
    return "resumed from a single-file (format 1) checkpoint"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Tensors, lists and ints only, so that it loads with torch.load(weights_only=True)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]  # format-1 checkpoints hold an array here: the same either way
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
