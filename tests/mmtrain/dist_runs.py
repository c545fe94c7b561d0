"""Launching training runs for the distributed tests (`python` or `torchrun --standalone`, one thread
per process) and reading back what they logged. Also the parity worker:
`python tests/mmtrain/dist_runs.py parity CONFIG OUT [STEPS]` trains STEPS steps on the same global
batches (read in one process, split by data-parallel rank); `... state CONFIG OUT` resumes and
writes the full model and optimizer state.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
STEPS = 8
# small but complete: both task kinds with media, MoE, sparse layers; one val batch per rank
RUN_OVERRIDES = ["dist.timeout_s=60", "train.threads=1", "train.eval_batches=1", "train.log_every=1",
                 f"train.steps={STEPS}", "train.ckpt_every=2", "train.keep_last=4"]


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
    """`python ARGS` or `torchrun --standalone --nproc-per-node N ARGS`, one thread per process.

    The ranks are forked from a warm parent (warm_launch.py: torchrun's environment, real processes)
    unless the test is about torchrun itself (restarts, `--no-python`) or MMTRAIN_COLD_LAUNCH=1."""
    if nproc > 1 and os.environ.get("MMTRAIN_TEST_DISTRIBUTED") == "0":  # tests/conftest.py sets it
        raise AssertionError("a case that starts several ranks is marked @pytest.mark.distributed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    env.pop("MMTRAIN_TEST_DISTRIBUTED", None)
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                f"--max-restarts={max_restarts}", "--monitor-interval=0.2"]
    import warm_launch  # tests/ (on sys.path from tests/conftest.py; a cold worker never needs it)

    warm = max_restarts == 0 and args[0] != "--no-python" and os.environ.get("MMTRAIN_COLD_LAUNCH") != "1" \
        and warm_launch.can_fork(env)
    run = _warm if warm else _cold
    proc = run(cmd + args, args, nproc, env, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd + args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def _warm(cmd, args, nproc, env, timeout) -> subprocess.CompletedProcess:
    import warm_launch

    try:
        code, out, err = warm_launch.run(args, nproc, env, REPO, timeout)
    except TimeoutError as e:
        raise AssertionError(f"{' '.join(cmd)} timed out:\n{e}") from None
    return subprocess.CompletedProcess(cmd, code, out, err)


def _cold(cmd, args, nproc, env, timeout) -> subprocess.CompletedProcess:
    # its own session: on a timeout the whole tree goes (torchrun alone would orphan its workers)
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            raise AssertionError(f"{' '.join(cmd)} timed out:\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def train(config: Path, nproc: int = 1, *overrides: str, **kw) -> subprocess.CompletedProcess:
    sets = [a for o in overrides for a in ("--set", o)]
    return launch(["-m", "mmtrain.train", str(config), "--quiet", *sets], nproc, **kw)


# the mesh keys one process ignores (ParallelDims at world 1, no pipeline): a one-process run of a
# config is the same run whatever they say. AC, compile and the strategy (token weighting reads it) count.
MESH_ONLY = {"dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "pp_schedule", "pp_vision_stage", "pp_split",
             "backend", "timeout_s", "reshard_after_forward", "meta_init"}


def reference_key(config: Path, kind: str, nproc: int = 1) -> str:
    """What makes two reference runs the same run: the config without its run_dir (and, in one
    process, without the mesh keys), the kind of run (its steps) and the ranks."""
    raw = yaml.safe_load(config.read_text())
    raw.pop("run_dir", None)
    if nproc == 1:
        raw["dist"] = {k: v for k, v in raw.get("dist", {}).items() if k not in MESH_ONLY}
    text = json.dumps([raw, kind, nproc], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cache(config: Path, kind: str, nproc: int) -> Path | None:
    """This session's entry for the run (tests/conftest.py sets MMTRAIN_REFERENCE_CACHE); None: no cache."""
    root = os.environ.get("MMTRAIN_REFERENCE_CACHE")
    return Path(root) / f"{kind}-{nproc}-{reference_key(config, kind, nproc)}" if root else None


def _note(entry: Path, hit: bool) -> None:
    with open(entry.parent / "log.jsonl", "a") as f:
        f.write(json.dumps({"entry": entry.name, "hit": hit}) + "\n")


def _shared(entry: Path | None, produce, result: Path, copy) -> None:
    """`produce()` writes `result`; with a cache entry the first call stores a copy and later calls
    copy it back instead of producing it."""
    if entry is not None and entry.exists():
        copy(entry, result)
        _note(entry, True)
        return
    produce()
    if entry is not None:
        copy(result, entry)
        _note(entry, False)


def _copy_dir(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)


def parity_reference(config: Path, out: Path, steps: int = 10) -> dict:
    """The parity worker's one-process run of `config` (written to `out`, and returned): run once a
    session per distinct run (reference_key), copied to every later test that asks for it."""
    _shared(_cache(config, f"parity{steps}", 1),
            lambda: launch([str(HERE), "parity", str(config), str(out), str(steps)]), out, shutil.copyfile)
    return json.loads(out.read_text())


def reference_run(config: Path, nproc: int = 1) -> Path:
    """An uninterrupted `train(config, nproc)` into the config's run_dir, run once a session per
    distinct run and copied (metrics, logs, summary, checkpoints) for every later test asking for it."""
    run_dir = Path(yaml.safe_load(config.read_text())["run_dir"])
    _shared(_cache(config, f"train{STEPS}", nproc), lambda: train(config, nproc), run_dir, _copy_dir)
    return run_dir


@contextlib.contextmanager
def fake_process_group(world: int, rank: int = 0):
    """torch's fake process group as rank `rank` of `world` in this process (collectives answer
    nothing; tensors are real), torn down on exit. world 1: no process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def state_bytes(modules, experts: bool | None = None) -> int:
    """Unique storages' bytes of the modules' parameters and buffers (a DTensor's local shard; meta
    tensors hold none); with
    `experts`, only the routed experts' (True) or all but theirs (False)."""
    seen = {}
    for m in modules:
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            if experts is not None and (".experts." in name) != experts:
                continue
            local = t.to_local() if hasattr(t, "to_local") else t
            if local.is_meta:  # a shape without memory (a pipeline's evaluation skeleton)
                continue
            seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(seen.values())


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


def expert_bias(trainer) -> list[list[float]]:
    """Every MoE layer's balancing bias, in layer order; at dist.pp > 1 from the stages (each rank
    holds its layers'), gathered over the world."""
    import torch.distributed as dist

    if trainer.pipeline is None:
        return [m.router.expert_bias_E.tolist() for m in trainer.raw_model.moe_layers().values()]
    parts = trainer.pipeline.parts
    mine = {i: m.router.expert_bias_E.tolist() for p in parts for i, m in p.moe_layers().items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged = {i: b for d in every for i, b in d.items()}
    return [merged[i] for i in sorted(merged)]


def parity_worker(config: str, out: str, steps: int = 10) -> None:
    """Train `steps` steps on the same global batches (read in one process, split by rows)."""
    from mmtrain.config import load_config
    from mmtrain.data_pipelines.loader import build_loader
    from mmtrain.loop.trainer import Trainer
    from mmtrain.parallel.distributed import exit_now, init_distributed, shutdown
    from mmtrain.run_config import RunConfig

    cfg = load_config(RunConfig, config)
    env = init_distributed(cfg.dist, "cpu")
    trainer = Trainer(cfg, verbose=False, env=env)
    it = iter(build_loader(cfg.data, trainer.tokenizer, "train"))
    accum = cfg.train.grad_accum
    dims = trainer.dims  # the rows of this rank's data-parallel slot
    mine = [split_rows(next(it), dims.dp_rank, dims.dp_size) for _ in range(steps * accum)]
    stats, bias, parts = [], [], []  # the balancing bias moves by the all-reduced expert loads of each step
    balance, encoded = [], _count_encoded(trainer)
    for i in range(steps):
        stats.append(trainer.train_step(iter(mine[i * accum:(i + 1) * accum])))
        bias.append(expert_bias(trainer))
        parts.append(trainer.grad_parts.pop())  # log_every=1: grad_norm/*, update_ratio/*
        balance.append({**trainer.balancer.weights(), **trainer.balancer.scalars()})  # weights after the step
    encoded_R = _gathered(encoded[0], env)
    if env.is_main:
        Path(out).write_text(json.dumps({"loss": [s.loss for s in stats],
                                         "grad_norm": [s.grad_norm for s in stats],
                                         "tokens": [s.tokens for s in stats], "expert_bias": bias,
                                         "task_tokens": [s.task_tokens for s in stats],
                                         # token weighting's logged figures (None: off)
                                         "token_weighting": [s.figures.get("token_weighting") for s in stats],
                                         "traffic": trainer.traffic.sent,  # all steps (no fit)
                                         # dist.compile: the graphs Dynamo made on rank 0 (0 if eager)
                                         "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                                         # the last step's attention counts (log_every=1; {} under cp / tp)
                                         "attn": {str(i): a for i, a in trainer.objective.attn_stats.items()},
                                         "parts": parts, "balance": balance,
                                         # patches each rank's vision encoder took in (training forwards)
                                         "encoded_patches": encoded_R}))
    if env.distributed:
        shutdown()
        exit_now(0)


def _count_encoded(trainer) -> list[int]:
    """[patches]: what this rank's vision encoder takes in, counted by a forward pre-hook (balanced or
    not, the encoder module runs every encoding: vision.balance calls it on the patches it received).
    The encoder the training forwards use (`trainer.encoder`): under dist.pp stage 0's, not the
    evaluation replica's; 0 on a rank without stage 0."""
    count = [0]

    def hook(module, args):
        if module.training:
            count[0] += int(args[0].shape[0])

    if trainer.encoder is not None:
        trainer.encoder.vision.register_forward_pre_hook(hook)
    return count


def _gathered(value: int, env) -> list[int]:
    """Every rank's `value`, in rank order (one process: [value])."""
    import torch.distributed as dist

    if not env.distributed:
        return [value]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def state_worker(config: str, out: str) -> None:
    """Resume from the run directory's checkpoint at this mesh and write the full (unsharded)
    model and optimizer state, keyed by parameter name, from rank 0."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from mmtrain.config import load_config
    from mmtrain.loop.trainer import Trainer
    from mmtrain.parallel.distributed import exit_now, init_distributed, shutdown
    from mmtrain.run_config import RunConfig

    cfg = load_config(RunConfig, config)
    env = init_distributed(cfg.dist, "cpu")
    trainer = Trainer(cfg, verbose=False, env=env)
    # cpu_offload leaves ranks other than 0 empty: under dist.pp every rank keeps its stages' keys
    opts = StateDictOptions(full_state_dict=True, cpu_offload=trainer.pipeline is None)
    model = get_model_state_dict(trainer.trained, options=opts)
    optim = get_optimizer_state_dict(trainer.trained, trainer.optimizer, options=opts).get("state", {})
    if trainer.pipeline is not None:  # each rank holds its stages' keys: merge them
        model, optim = _merged(model), _merged(optim)
    if env.is_main:
        torch.save({"step": trainer.step, "model": model, "optim": optim}, out)
    if env.distributed:
        shutdown()
        exit_now(0)


def _merged(state: dict) -> dict:
    """Every rank's (full, CPU) entries, merged: dist.pp > 1 state lives on the stages' ranks."""
    import torch.distributed as dist

    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, _cpu(state))
    return {k: _cpu(v) for d in every for k, v in d.items()}


def _cpu(value):
    return {k: _cpu(v) for k, v in value.items()} if isinstance(value, dict) else \
        value.cpu() if isinstance(value, torch.Tensor) else value


if __name__ == "__main__":
    if sys.argv[1] == "parity":
        parity_worker(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:5]))
    elif sys.argv[1] == "state":
        state_worker(sys.argv[2], sys.argv[3])
