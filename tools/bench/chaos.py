"""A chaos run: N training runs under `torchrun --max-restarts 1`, each hit by one fault at a random
(step, rank, kind), kind in kill (SIGKILL after a step), stop (SIGSTOP: hung, alive), kill-in-save
(SIGKILL in an asynchronous checkpoint write) and nan (a NaN loss on one rank).

    python -m tools.bench.chaos --faults 24 --seed 0 --out runs/chaos.jsonl

Each run is 4 ranks on gloo, EP(2) x FSDP(2), on the built-in corpus, a checkpoint every 2 steps.
The harness reads the launch's output line by line as it arrives and times:

- detection: from the fault's own line (`mmtrain: fault: ...`) to the first line that shows the job
  acting on it: a heartbeat verdict (`heartbeat: rank R silent ...`) or torchrun stopping the
  group; for nan, to the faulty rank's line that the step was skipped (every rank's skip is
  checked in metrics.jsonl);
- steps lost: the fault's step minus the step the restart resumed from (the steps trained again);
- after the restart, every step's loss against an uninterrupted run of the same config (nan: the
  skipped step is the fault's, the steps before it equal the reference's).

The outer timeout (--timeout per launch) must never fire: a launch it ends is counted as a hang.
Every fault's record is appended to --out as it finishes; the table at the end reads that file.
The runs train the committed code (HEAD, copied once): the reference and every fault must run the
same code, and a working tree may change under a run of many minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
KINDS = ("kill", "stop", "kill-in-save", "nan")
NPROC = 4
# the tests' tiny model (tests/mmtrain/conftest.py) on the drills' mesh: a step is a fraction of a second
RUN = ["data.num_workers=0", "data.batch_size=1", "data.seq_len=192", "data.shuffle_buffer=8",
       "data.media.max_pixels=2304", "model.vision.dim=32", "model.vision.depth=1", "model.vision.n_heads=2",
       "model.decoder.dim=32", "model.decoder.n_layers=2", "model.decoder.n_heads=2",
       "model.decoder.n_kv_heads=1", "model.decoder.ffn_dim=64", "model.decoder.mrope_sections=[2, 3, 3]",
       "model.decoder.moe.n_routed=4", "model.decoder.moe.expert_dim=32", "model.visual_head=false",
       "loss.visual_next.weight=0", "loss.balancer.kind=static", "diagnostics.every=0", "captions.images=0",
       "captions.videos=0", "optim.warmup_steps=2", "train.eval_every=0", "train.eval_batches=1",
       "train.log_every=1", "train.ckpt_every=2", "train.keep_last=8", "train.threads=1",
       "dist.ep=2", "dist.timeout_s=60"]
ACTED = re.compile(r"heartbeat: |closing signal|Worker group FAILED")
# setup.py's ROOTS: an editable install maps these to the checkout's folders, whatever the cwd
MAPPED = {"models": "../models", "data_pipelines": "../data_pipelines",
          "attention_maps": "../tools/attention_maps"}


def fault_sets(kind: str, step: int, rank: int) -> list[str]:
    knob = {"kill": "kill_at_step", "stop": "stop_at_step", "kill-in-save": "kill_in_save_at_step",
            "nan": "nan_at_step"}[kind]
    extra = ["train.async_save=true"] if kind == "kill-in-save" else []
    return [f"train.faults.{knob}={step}", f"train.faults.rank={rank}", *extra]


def draw(rng: random.Random, steps: int, every: int) -> tuple[str, int, int]:
    """A random (kind, step, rank): kills and stops after a step before the last; a kill in a save at
    a checkpoint step before the last (the last save is synchronous); a NaN at any step."""
    kind = rng.choice(KINDS)
    if kind == "kill-in-save":
        step = rng.choice(range(every, steps, every))
    elif kind == "nan":
        step = rng.randint(1, steps)
    else:
        step = rng.randint(1, steps - 1)
    return kind, step, rng.randrange(NPROC)


def frozen(root: Path) -> Path:
    """HEAD's files in root/src, with links that make its own folders the mapped packages (links in
    its `mmtrain` are found before the editable install's mapping to the working tree)."""
    src = root / "src"
    src.mkdir()
    tar = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=tar, check=True)
    for name, target in MAPPED.items():
        (src / "mmtrain" / name).symlink_to(target)
    return src


def launch(src: Path, config: Path, sets: list[str], timeout: float) -> tuple[int | None, list]:
    """torchrun --max-restarts 1 on `config`, in the code of `src`; -> (exit code, None if the timeout
    ended it; the output lines with their arrival times)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
           "--max-restarts=1", "--monitor-interval=0.2", "-m", "mmtrain.train", str(config), "--quiet",
           *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    lines: list[tuple[float, str]] = []
    with subprocess.Popen(cmd, cwd=src, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as p:
        read = lambda: lines.extend((time.time(), ln) for ln in p.stdout)  # noqa: E731
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            code = None
        reader.join(timeout=10)
    return code, lines


def losses(run_dir: Path) -> dict[int, dict]:
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in recs if "eval" not in r}  # a replayed step: the later line wins


def judge(kind: str, step: int, rank: int, code, lines, run_dir: Path, ref: dict[int, dict]) -> dict:
    """One fault's record: detection latency, who was named, steps lost, steps altered or missing."""
    out = {"kind": kind, "step": step, "rank": rank, "exit": code, "hang": code is None}
    t_fault = next((t for t, ln in lines if "mmtrain: fault:" in ln), None)
    if kind == "nan":
        t_done = next((t for t, ln in lines if f"NaN step {step} skipped" in ln), None)
    else:
        after = [(t, ln) for t, ln in lines if t_fault is not None and t >= t_fault]
        t_done, by = next(((t, ln) for t, ln in after if ACTED.search(ln)), (None, ""))
        out["by"] = "heartbeat" if "heartbeat: " in by else "torchrun" if by else None
        named = [ln for _, ln in lines if "heartbeat: " in ln]
        out["named"] = sorted({int(r) for ln in named for r in re.findall(r"rank (\d+) silent", ln)})
    out["latency_s"] = None if t_fault is None or t_done is None else round(t_done - t_fault, 3)
    got = losses(run_dir) if (run_dir / "metrics.jsonl").exists() else {}
    out["missing"] = sorted(set(ref) - set(got))
    if kind == "nan":
        skipped = sorted(s for s, r in got.items() if r["skipped"])
        out["skipped"] = skipped
        out["altered"] = sorted(s for s in ref if s < step and s in got and got[s]["loss"] != ref[s]["loss"])
        out["ok"] = skipped == [step] and not out["missing"] and not out["altered"] and code == 0
        out["steps_lost"] = 0
        return out
    log = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""
    resumed = re.findall(r"resumed from \S+ at step (\d+)", log)
    out["resumed_from"] = int(resumed[-1]) if resumed else 0
    out["steps_lost"] = step - out["resumed_from"]
    out["altered"] = sorted(s for s in ref if s in got and got[s]["loss"] != ref[s]["loss"])
    named_ok = kind != "stop" or out["named"] == [rank]  # a stop is the heartbeat's to name
    out["ok"] = code == 0 and not out["missing"] and not out["altered"] and named_ok
    return out


def setup(root: Path, corpus: Path | None, steps: int) -> Path:
    """The run config (configs/tiny.yaml, the tiny model, the built-in corpus written if not given)."""
    from mmtrain.config import apply_override

    if corpus is None:
        from mmtrain.data_pipelines.synth.config import SynthConfig
        from mmtrain.data_pipelines.synth.writer import write_corpus

        corpus = root / "shapes"
        write_corpus(corpus, SynthConfig.small())
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    raw["data"]["tokenizer"] = str(corpus / "tokenizer.json")
    for split in ("train", "val"):
        for src in raw["data"][split]:
            src["shards"] = [str(corpus / split / f"{src['name']}-*.tar")]
    for item in [*RUN, f"train.steps={steps}"]:
        apply_override(raw, item)
    config = root / "chaos.yaml"
    config.write_text(yaml.safe_dump(raw))
    return config


def table(records: list[dict]) -> str:
    """Per kind: faults, hangs, detection latency (median, p95), steps lost (median, max), bad runs."""
    rows = ["| kind | faults | hangs | detected by | detection median | detection p95 | "
            "steps lost (median / max) | runs not exact |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    for kind in KINDS:
        recs = [r for r in records if r["kind"] == kind]
        if not recs:
            continue
        lat = sorted(r["latency_s"] for r in recs if r["latency_s"] is not None)
        lost = [r["steps_lost"] for r in recs]
        p95 = lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))] if lat else float("nan")
        med = statistics.median(lat) if lat else float("nan")
        who = [r.get("by") or "the step's all-reduce" for r in recs]
        by = ", ".join(f"{w} {who.count(w)}" for w in sorted(set(who)))
        hangs, bad = sum(r["hang"] for r in recs), sum(not r["ok"] for r in recs)
        rows.append(f"| {kind} | {len(recs)} | {hangs} | {by} | {med:.2f} s | {p95:.2f} s | "
                    f"{statistics.median(lost):g} / {max(lost)} | {bad} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", type=int, default=20, help="runs, one fault each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=300, help="the outer timeout of one launch (s)")
    ap.add_argument("--corpus", type=Path, help="a shapes-world corpus (default: written to a temp dir)")
    ap.add_argument("--out", type=Path, default=Path("runs/chaos.jsonl"), help="one JSON line per fault")
    ap.add_argument("sets", nargs="*", help="more overrides, key=value (e.g. train.heartbeat.floor_s=5)")
    ap.add_argument("--table", type=Path, help="only print the table of this --out file")
    args = ap.parse_args(argv)
    if args.table is not None:
        print(table([json.loads(ln) for ln in args.table.read_text().splitlines()]))
        return
    rng = random.Random(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        root = Path(tmp)
        config, src = setup(root, args.corpus, args.steps), frozen(root)
        code, _ = launch(src, config, [f"run_dir={root / 'ref'}", *args.sets], args.timeout)
        assert code == 0, "the uninterrupted reference run failed"
        ref = losses(root / "ref")
        median_step = statistics.median(r["step_s"] for r in ref.values())
        records = []
        for i in range(args.faults):
            kind, step, rank = draw(rng, args.steps, 2)
            run_dir = root / f"run{i}"
            t0 = time.monotonic()
            sets = [f"run_dir={run_dir}", *fault_sets(kind, step, rank), *args.sets]
            code, lines = launch(src, config, sets, args.timeout)
            rec = {"i": i, **judge(kind, step, rank, code, lines, run_dir, ref),
                   "wall_s": round(time.monotonic() - t0, 1)}
            records.append(rec)
            with args.out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(json.dumps(rec), flush=True)
    print(f"# {len(records)} faults, seed {args.seed}, {args.steps} steps a run, {NPROC} ranks "
          f"EP(2) x FSDP(2), median step {median_step:.2f} s (reference run)")
    print(table(records))


if __name__ == "__main__":
    main()
