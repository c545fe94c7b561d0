"""Pipeline schedules: bubble fractions from the schedules' own action lists, and a measured step time.

    python -m tools.bench.bench_pipeline [--stages 4] [--microbatches 8 16 32]     # bubbles only
    python -m tools.bench.bench_pipeline --measure [--steps 6]                     # + PP(2) on gloo

Bubbles: torch builds each schedule's per-rank action lists (`pipeline_order`, as the runtime
executes them); `simulate` replays them with unit costs F = 1, full backward B = 2, the split
backward's I = W = 1 (a virtual stage of a looped / V schedule costs 1 / stages-per-rank of that),
each action starting when its rank is free and its inputs exist (F(s, m) after F(s-1, m); B or
I(s, m) after B or I(s+1, m), the last stage's after its own F). Bubble = idle / (ranks x makespan).
Communication is free here: the bubble is the schedule's, not the network's.

Measured: one process against PP(2) (2 gloo processes, 1 thread each) training the same tiny model
(configs/tiny.yaml's, 4 layers) on the same micro-batches of the built-in corpus, median step time
over the steps after the first; both sides use the objective's loss (mmtrain/loop/pipeline_step.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")


def actions(name: str, pp: int, m: int) -> list[list]:
    """Each rank's compute actions, in order, as torch's schedule lists them. The single-stage
    schedules' lists come out of torch's visualizer with shifted micro-batch ids on ranks > 0 (it
    mocks every stage as group rank 0; their runtime does not read those lists), so GPipe and 1F1B
    are listed here by their definitions: all F then all B; p - 1 - r warm-up F, then F B pairs."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import _Action
    from torch.distributed.pipelining.schedules import _ComputationType as C

    if name in ("GPipe", "1F1B"):
        out = []
        for r in range(pp):
            warm = m if name == "GPipe" else min(m, pp - 1 - r)
            ops = [_Action(r, C.FORWARD, i) for i in range(warm)]
            for i in range(m - warm):
                ops += [_Action(r, C.FORWARD, warm + i), _Action(r, C.FULL_BACKWARD, i)]
            out.append(ops + [_Action(r, C.FULL_BACKWARD, i) for i in range(m - warm, m)])
        return out
    compute = (C.FORWARD, C.FULL_BACKWARD, C.BACKWARD_INPUT, C.BACKWARD_WEIGHT, C.OVERLAP_F_B)
    return [[a for a in rank if a is not None and a.computation_type in compute]
            for rank in get_schedule_ops(name, pp, m)]


def simulate(per_rank: list[list], stages_per_rank: int) -> float:
    """-> the bubble fraction of these action lists under the unit costs above."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    unit = 1.0 / stages_per_rank
    cost = {C.FORWARD: unit, C.FULL_BACKWARD: 2 * unit, C.BACKWARD_INPUT: unit, C.BACKWARD_WEIGHT: unit}
    n_stages = 1 + max(a.stage_index for r in per_rank for a in r for a in _leaves(a))
    done: dict[tuple, float] = {}
    free = [0.0] * len(per_rank)
    pos = [0] * len(per_rank)
    busy = 0.0
    while any(p < len(r) for p, r in zip(pos, per_rank)):
        progressed = False
        for rank, ops in enumerate(per_rank):
            if pos[rank] >= len(ops):
                continue
            leaves = _leaves(ops[pos[rank]])
            deps = [d for a in leaves for d in _deps(a, n_stages)]
            if any(d not in done for d in deps):
                continue
            start = max([free[rank], *(done[d] for d in deps)])
            for a in leaves:  # an overlapped F+B pair runs its halves back to back
                start += cost[a.computation_type]
                busy += cost[a.computation_type]
                done[_key(a)] = start
            free[rank], pos[rank], progressed = start, pos[rank] + 1, True
        if not progressed:
            raise RuntimeError("schedule deadlocks under the simulation's dependencies")
    return 1.0 - busy / (len(per_rank) * max(free))


def _leaves(a) -> list:
    return list(a.sub_actions) if getattr(a, "sub_actions", None) else [a]


def _key(a) -> tuple:
    from torch.distributed.pipelining.schedules import _ComputationType as C

    kind = "B" if a.computation_type in (C.FULL_BACKWARD, C.BACKWARD_INPUT) else a.computation_type.value
    return (a.stage_index, kind, a.microbatch_index)


def _deps(a, n_stages: int) -> list[tuple]:
    from torch.distributed.pipelining.schedules import _ComputationType as C

    s, m, t = a.stage_index, a.microbatch_index, a.computation_type
    if t == C.FORWARD:
        return [(s - 1, "F", m)] if s > 0 else []
    if t == C.BACKWARD_WEIGHT:
        return [(s, "B", m)]
    return [(s, "F", m)] if s == n_stages - 1 else [(s + 1, "B", m), (s, "F", m)]


def bubbles(pp: int, microbatches: list[int]) -> list[dict]:
    from mmtrain.parallel.pipeline import stages_per_rank

    rows = []
    for name in SCHEDULES:
        row = {"schedule": name, "stages_per_rank": stages_per_rank(name)}
        for m in microbatches:
            try:
                row[f"m={m}"] = simulate(actions(name, pp, m), stages_per_rank(name))
            except Exception as e:  # a (pp, m) the schedule does not accept
                row[f"m={m}"] = f"n/a ({type(e).__name__})"
        rows.append(row)
    return rows


# ----- measured step time ------------------------------------------------------------------------
def child(config: str, schedule: str, steps: int, out: str) -> None:
    """Under torchrun (PP) or alone (one process): train `steps` steps, write the step times."""
    import torch
    import torch.distributed as dist
    import yaml

    from mmtrain.config import from_dict
    from mmtrain.data_pipelines.batch import TASK_NAMES
    from mmtrain.data_pipelines.loader import build_loader
    from mmtrain.data_pipelines.tokenizer import load_tokenizer
    from mmtrain.loop.pipeline_step import PipelineStep
    from mmtrain.models.multimodal import MultimodalModel
    from mmtrain.objectives.balance import build_balancer
    from mmtrain.objectives.objective import Objective
    from mmtrain.optim import build_optimizer
    from mmtrain.parallel.distributed import DistEnv
    from mmtrain.parallel.pipeline import build_stage_models, pp_grad_norm
    from mmtrain.run_config import RunConfig

    torch.set_num_threads(1)
    pp = int(os.environ.get("WORLD_SIZE", 1))
    if pp > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if pp > 1 else 0
    cfg = from_dict(RunConfig, yaml.safe_load(Path(config).read_text()), source=config)
    tok = load_tokenizer(cfg.data.tokenizer)
    cfg.model.decoder.vocab_size = tok.vocab_size
    accum = cfg.train.grad_accum
    it = iter(build_loader(cfg.data, tok, "train", 0, 1))
    batches = [next(it) for _ in range(steps * accum)]
    torch.manual_seed(0)
    model = MultimodalModel(cfg.model)
    balancer = build_balancer(cfg.loss.balancer, {t: getattr(cfg.loss, t) for t in TASK_NAMES})
    parts = build_stage_models(model, schedule, rank, pp, cfg.data.seq_len) if pp > 1 else [model]
    last = next((p for p in parts if getattr(p, "is_last", True)), parts[-1])
    obj = Objective(cfg, last, balancer, env=DistEnv(rank, pp), device=torch.device("cpu"), raw_model=last,
                    pp=pp)
    run = PipelineStep(obj, parts, schedule, None, torch.device("cpu"), accum) if pp > 1 else None
    opts = [build_optimizer(p, cfg.optim) for p in parts]
    times = []
    for step in range(steps):
        if pp > 1:
            dist.barrier()
        t0 = time.perf_counter()
        sums = obj.begin_step(step)
        step_batches = batches[step * accum:(step + 1) * accum]
        if run is not None:
            run.run(step_batches, sums)
            pp_grad_norm(parts, None, cfg.optim.grad_clip)
        else:
            for b in step_batches:
                (obj.micro_batch(b, sums) / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if pp > 1:
            dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    if pp > 1:
        dist.destroy_process_group()


def measure(steps: int, schedule: str, layers: int, accum: int) -> dict:
    import yaml

    from mmtrain.config import apply_override
    from mmtrain.data_pipelines.synth.config import SynthConfig
    from mmtrain.data_pipelines.synth.writer import write_corpus

    tmp = Path(tempfile.mkdtemp(prefix="bench_pipeline_"))
    write_corpus(tmp / "corpus", SynthConfig.small())
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    for split in ("train", "val"):
        for src in raw["data"][split]:
            src["shards"] = [str(tmp / "corpus" / split / f"{src['name']}-*.tar")]
    for item in [f"data.tokenizer={tmp / 'corpus' / 'tokenizer.json'}", "data.num_workers=0",
                 f"model.decoder.n_layers={layers}", f"train.grad_accum={accum}", "data.batch_size=2",
                 "model.visual_head=false", "loss.visual_next.weight=0", "data.shuffle_buffer=8"]:
        apply_override(raw, item)
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(raw))
    out = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for nproc in (1, 2):
        cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
                                  if nproc > 1 else [])
        cmd += [str(Path(__file__)), "--child", str(tmp / "cfg.yaml"), schedule, str(steps),
                str(tmp / f"t{nproc}.json")]
        subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
        times = json.loads((tmp / f"t{nproc}.json").read_text())[1:]
        out[nproc] = statistics.median(times)
    return {"schedule": schedule, "layers": layers, "grad_accum": accum, "one_process_s": out[1],
            "pp2_s": out[2], "ratio": out[2] / out[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, default=4, help="pipeline ranks (m3 runs 4)")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--measure", action="store_true", help="also time PP(2) on gloo against one process")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--schedule", default="1F1B")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), args.child[3])
        return
    print(f"bubble fraction at {args.stages} ranks (F = 1, B = 2, I = W = 1; no communication cost)")
    heads = " ".join(f"{'m=' + str(m):>8}" for m in args.microbatches)
    print(f"{'schedule':<16} {'stages/rank':>11} {heads}")
    for row in bubbles(args.stages, args.microbatches):
        cells = [row[f"m={m}"] for m in args.microbatches]
        print(f"{row['schedule']:<16} {row['stages_per_rank']:>11} "
              + " ".join(f"{c:>8.3f}" if isinstance(c, float) else f"{c:>8}" for c in cells))
    p = args.stages
    print("1F1B's closed form (p - 1) / (m + p - 1): "
          + ", ".join(f"m={m}: {(p - 1) / (m + p - 1):.3f}" for m in args.microbatches))
    if args.measure:
        r = measure(args.steps, args.schedule, 4, 4)
        print(f"measured ({r['schedule']}, {r['layers']} layers, grad_accum {r['grad_accum']}): one process "
              f"{r['one_process_s'] * 1e3:.0f} ms/step, PP(2) on gloo {r['pp2_s'] * 1e3:.0f} ms/step "
              f"(x{r['ratio']:.2f})")


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    main()
