"""The modality-collapse experiment: arms x seeds on the built-in corpus, one table.

An experiment file (configs/experiments/collapse/experiment.yaml) names a base run config and the
arms, each a list of `--set` overrides of it; every arm trains on the same token budget (same
steps, rows and row length). Each (arm, seed) is one `python -m mmtrain.train` process with its
own run directory, `--jobs` at a time with `--threads` each. A run whose summary.json exists is
not run again, so an interrupted experiment continues where it stopped.

    python -m tools.experiments.collapse                        # the whole experiment (< 1 h, 2 cores)
    python -m tools.experiments.collapse --arms static,staged --seeds 0
    python -m tools.experiments.collapse --smoke --out /tmp/smoke   # seconds: wiring only (CI)
    python -m tools.experiments.collapse --arms contrast --seeds 4 --nproc 2 --set dist.cp=2  # torchrun

Writes OUT/results.json, OUT/table.md and OUT/*.png (copied to --report DIR when given).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mmtrain.config import load_config
from mmtrain.errors import ConfigError, UserError
from mmtrain.run_config import RunConfig
from tools.experiments.onset_report import load_pool, onset_summary
from tools.experiments.summarize import read_run, summarize_runs, write_outputs

DEFAULT = Path("configs/experiments/collapse/experiment.yaml")
# --smoke: a few steps of each arm on a few tokens (checks the wiring of every arm, not results)
SMOKE = ["train.steps=4", "data.batch_size=2", "data.seq_len=128", "data.num_workers=0",
         "data.shuffle_buffer=8", "train.eval_batches=1", "diagnostics.every=2", "diagnostics.batches=1",
         "diagnostics.max_rows=16", "diagnostics.warmup_steps=0", "train.log_every=2", "train.ckpt_every=0",
         "loss.balancer.window=1"]


@dataclass
class Experiment:
    base: Path
    seeds: list[int]
    arms: dict[str, list[str]]
    collapse_gap: float = 0.05  # a media task whose final reliance gap is below this has collapsed
    notes: dict[str, str] = field(default_factory=dict)  # arm -> one line for the table
    common: list[str] = field(default_factory=list)  # overrides of every arm (before the arm's own)


@dataclass
class Run:
    arm: str
    seed: int
    run_dir: Path
    overrides: list[str]
    record: Path | None = None  # --records: the finished run's summary, kept where a stop cannot lose it

    def done(self) -> bool:
        return (self.run_dir / "summary.json").exists() or bool(self.record and self.record.exists())

    def read(self) -> dict:
        """The run's summary (summarize.read_run), from its record when its directory is gone."""
        if self.record and self.record.exists() and not (self.run_dir / "summary.json").exists():
            return json.loads(self.record.read_text(encoding="utf-8"))
        return read_run(self.run_dir)


def load_experiment(path: Path) -> Experiment:
    if not path.is_file():
        raise ConfigError(f"{path}: experiment file not found")
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    known = {"base", "seeds", "arms", "collapse_gap", "notes", "common"}
    if not isinstance(raw, dict) or set(raw) - known:
        raise ConfigError(f"{path}: expected a mapping with keys {sorted(known)}")
    if not isinstance(raw.get("arms"), dict) or not raw["arms"]:
        raise ConfigError(f"{path}: arms: need a mapping arm name -> list of KEY=VALUE overrides")
    arms = {}
    for name, items in raw["arms"].items():
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ConfigError(f"{path}: arms.{name}: need a list of KEY=VALUE strings")
        arms[str(name)] = items
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ConfigError(f"{path}: seeds: need a non-empty list of integers")
    common = raw.get("common") or []
    if not isinstance(common, list) or not all(isinstance(i, str) for i in common):
        raise ConfigError(f"{path}: common: need a list of KEY=VALUE strings")
    return Experiment(path.parent / raw.get("base", "base.yaml"), seeds, arms,
                      float(raw.get("collapse_gap", 0.05)), dict(raw.get("notes") or {}), common)


def plan_runs(exp: Experiment, out: Path, arms: list[str], seeds: list[int], extra: list[str],
              records: Path | None = None) -> list[Run]:
    """Every (arm, seed), its overrides checked now: a typo fails before anything trains."""
    runs = []
    for arm in arms:
        if arm not in exp.arms:
            raise UserError(f"--arms: unknown arm {arm!r} (known: {', '.join(exp.arms)})")
        for seed in seeds:
            run_dir = out / arm / f"seed{seed}"
            overrides = [*exp.common, *exp.arms[arm], f"train.seed={seed}", f"data.seed={seed}", *extra,
                         f"run_dir={run_dir}"]
            load_config(RunConfig, exp.base, overrides)
            record = records / arm / f"seed{seed}.json" if records else None
            runs.append(Run(arm, seed, run_dir, overrides, record))
    return runs


def attn_one(run: Run, n_docs: int, threads: int) -> int:
    """The attention-map CLI's val report on the run's final checkpoint -> RUN/attn/metrics.json."""
    out = run.run_dir / "attn"
    if (out / "metrics.json").exists() or not (run.run_dir / "summary.json").exists():
        return 0  # cached, or only its record is left
    summary = json.loads((run.run_dir / "summary.json").read_text(encoding="utf-8"))
    cmd = [sys.executable, "-m", "mmtrain.attention_maps.cli", "--ckpt", summary["checkpoint"],
           "--from-val", str(n_docs), "--out", str(out), "--threads", str(threads)]
    with open(run.run_dir / "attn.log", "w", encoding="utf-8") as log:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode


def run_one(run: Run, base: Path, threads: int, force: bool, nproc: int = 1) -> tuple[Run, float, int]:
    if run.done() and not force:
        return run, 0.0, 0
    if run.run_dir.exists():
        shutil.rmtree(run.run_dir)  # a partial run restarts from scratch: same steps for every arm
    run.run_dir.mkdir(parents=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    launcher = torchrun if nproc > 1 else [sys.executable]  # nproc > 1: the mesh from --set dist.*
    cmd = [*launcher, "-m", "mmtrain.train", str(base), "--quiet",
           "--set", f"train.threads={threads}", *[a for o in run.overrides for a in ("--set", o)]]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    with open(run.run_dir / "stdout.log", "w", encoding="utf-8") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    seconds = time.perf_counter() - t0
    if code == 0 and run.record is not None:
        write_record(run, seconds)
    return run, seconds, code


def write_record(run: Run, seconds: float) -> None:
    """RECORDS/ARM/seedN.json: read_run's summary, the overrides, the commit and the wall time."""
    here = Path(__file__).resolve().parent  # the code's checkout, wherever the runs are launched from
    commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    record = {**read_run(run.run_dir), "overrides": run.overrides, "commit": commit, "wall_s": seconds}
    run.record.parent.mkdir(parents=True, exist_ok=True)
    tmp = run.record.with_suffix(".tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    tmp.replace(run.record)  # atomic: a stop mid-write leaves no half record


def matched_overrides(exp: Experiment, out: Path, arm: str, seeds: str | None) -> list[str]:
    """`data.train.N.weight=...` for a fixed mix at ARM's realised average document shares: the fair
    control for an adaptive mixture (same media documents on average, but not when it chose)."""
    chosen = [int(s) for s in seeds.split(",")] if seeds else exp.seeds
    runs = plan_runs(exp, out, [arm], chosen, [])
    missing = [str(r.run_dir) for r in runs if not r.done()]
    if missing:
        raise UserError(f"--matched {arm}: unfinished runs {missing}")
    means = [r.read()["mix_mean"] for r in runs]
    if not all(means):
        raise UserError(f"--matched {arm}: its runs logged no mixture shares (no controller?)")
    shares = {n: sum(m[n] for m in means) / len(means) for n in means[0]}
    names = [s.name for s in load_config(RunConfig, exp.base, exp.common + exp.arms[arm]).data.train]
    return [f"data.train.{i}.weight={shares[n]:.4f}" for i, n in enumerate(names)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.experiments.collapse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiment", type=Path, default=DEFAULT)
    p.add_argument("--out", type=Path, default=Path("runs/collapse"))
    p.add_argument("--arms", help="comma-separated subset of the arms (default: all)")
    p.add_argument("--seeds", help="comma-separated seeds (default: the experiment's)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--nproc", type=int, default=1,
                   help="processes per run: > 1 launches each run with torchrun (--standalone), e.g. "
                        "with --set dist.cp=2; --threads is per process (default 1)")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                   help="override every arm's config (repeatable)")
    p.add_argument("--smoke", action="store_true", help="a few steps per arm: checks wiring, not results")
    p.add_argument("--force", action="store_true", help="rerun runs that already have a summary")
    p.add_argument("--summarize-only", action="store_true",
                   help="train nothing: the table and plots of the finished runs (the others are listed)")
    p.add_argument("--report", type=Path, help="also copy table.md, results.json and plots here")
    p.add_argument("--records", type=Path, help="write each finished run's summary to RECORDS/ARM/seedN.json "
                                                "(a run with a record is done, its directory gone or not)")
    p.add_argument("--onset-ref", metavar="ARM", help="the onset table's reference arm (default: static)")
    p.add_argument("--pool", action="append", default=[], metavar="RESULTS:ARM[,ARM]",
                   help="pool these arms' runs of an earlier experiment's results.json into the reference")
    p.add_argument("--attn", type=int, default=0, metavar="N",
                   help="also run `mmtrain-attn --from-val N` on each run's final checkpoint (its "
                        "pointing game goes into the table; cached in RUN/attn/)")
    p.add_argument("--matched", metavar="ARM",
                   help="print the data.train weights of a fixed mix matched to ARM's finished runs "
                        "(its document shares averaged over steps and seeds), as --set overrides")
    args = p.parse_args(argv)

    from mmtrain.errors import run_guarded

    return run_guarded(lambda: _run(args))


def _run(args) -> int:
    exp = load_experiment(args.experiment)
    if args.matched:
        print(" ".join(matched_overrides(exp, args.out, args.matched, args.seeds)))
        return 0
    arms = args.arms.split(",") if args.arms else list(exp.arms)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else exp.seeds
    extra = (SMOKE if args.smoke else []) + args.extra
    runs = plan_runs(exp, args.out, arms, seeds, extra, args.records)
    print(f"{len(runs)} runs ({len(arms)} arms x {len(seeds)} seeds), {args.jobs} at a time -> {args.out}",
          flush=True)
    t0 = time.perf_counter()
    failed, trained = [], 0
    if args.summarize_only:  # the table of what has finished; nothing trains
        missing = [r for r in runs if not r.done()]
        runs = [r for r in runs if r.done()]
        print(f"  {len(missing)} unfinished run(s) left out: "
              + (", ".join(f"{r.arm}/seed{r.seed}" for r in missing) or "none"), flush=True)
        if not runs:
            raise UserError("--summarize-only: no finished run to summarise")
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        jobs = [pool.submit(run_one, r, exp.base, args.threads, args.force, args.nproc) for r in runs]
        for job in jobs:
            run, seconds, code = job.result()
            state = "cached" if seconds == 0 and code == 0 else ("ok" if code == 0 else f"FAILED ({code})")
            print(f"  {run.arm:<16} seed {run.seed}: {state} {seconds / 60:5.1f} min  {run.run_dir}",
                  flush=True)
            if code:
                failed.append(run)
            trained += seconds > 0
    if failed:
        raise UserError(f"{len(failed)} run(s) failed; see {failed[0].run_dir / 'stdout.log'}")
    if args.attn:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            codes = list(pool.map(lambda r: attn_one(r, args.attn, args.threads), runs))
        if any(codes):
            bad = runs[[bool(c) for c in codes].index(True)]
            raise UserError(f"mmtrain-attn failed on {sum(map(bool, codes))} run(s); "
                            f"see {bad.run_dir / 'attn.log'}")
    results = summarize_runs(runs, exp)
    ref = args.onset_ref or ("static" if "static" in arms else None)
    if ref:
        pool = [r for spec in args.pool for r in load_pool(spec)]
        results["onset"] = onset_summary(results["runs"], exp.collapse_gap, ref, pool)
    results["wall_min"] = (time.perf_counter() - t0) / 60  # of this invocation
    results["trained_now"] = trained  # runs trained by it (the others were already finished)
    results["command"] = "python -m tools.experiments.collapse " + " ".join(sys.argv[1:])
    written = write_outputs(results, args.out, args.report)
    print((args.out / "table.md").read_text(encoding="utf-8"))
    print(f"wrote {', '.join(str(w) for w in written)} in {results['wall_min']:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
