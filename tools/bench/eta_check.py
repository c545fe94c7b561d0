"""How right the progress line's ETA was: for a finished run, the predicted end (the wall time of a
step + its ETA) against the run's real end, at each minute mark.

    python -m tools.bench.eta_check runs/tiny

Reads metrics.jsonl (`wall_s`, `eta_s` per step) and summary.json (`wall_s` at the end), both written
by the trainer (mmtrain/loop/eta.py); one launch only (a resumed run restarts its clock).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def marks(records: list[dict], end_s: float, every_s: float = 60.0) -> list[tuple[float, float, float]]:
    """(wall_s, predicted end, error as a share of the real remaining time) at the first step past
    each `every_s` mark."""
    out, next_mark = [], every_s
    for r in records:
        if r.get("eta_s") is None or r["wall_s"] < next_mark:
            continue
        predicted = r["wall_s"] + r["eta_s"]
        out.append((r["wall_s"], predicted, (predicted - end_s) / max(end_s - r["wall_s"], 1e-9)))
        next_mark = (r["wall_s"] // every_s + 1) * every_s
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--every", type=float, default=60.0, help="seconds between the marks")
    a = p.parse_args(argv)
    end_s = json.loads((a.run_dir / "summary.json").read_text())["wall_s"]
    lines = (a.run_dir / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines if line.strip()]
    recs = [r for r in recs if "wall_s" in r and "eval" not in r]
    print(f"run ended at {end_s:.0f} s (from the trainer's start)")
    print("| at | ETA said the run ends at | error (share of the time left) |\n|---|---|---|")
    for wall, pred, err in marks(recs, end_s, a.every):
        print(f"| {wall:.0f} s | {pred:.0f} s | {err:+.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
