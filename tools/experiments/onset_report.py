"""The onset table of a collapse experiment: when each run starts reading the pixels, and whether it reads.

Per run (summarize.read_run's dict): the onset is the first diagnostics check whose image mismatch
gap reaches ONSET_GAP (censored at the last check when none does); the run *reads* when its final
mismatch gap -- the final eval's on the whole val split where logged, else the last diagnostics
run's -- reaches the experiment's collapse_gap. Per arm: reads k/n, the onsets, the Kaplan-Meier
median and the log-rank p against a reference arm (optionally pooled with another experiment's runs).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from tools.experiments.survival import as_events, km_curve, km_median, log_rank, onset

ONSET_GAP = 0.02  # nats: the first check at or above this is the onset of reading
TASK = "image_text"


def final_mismatch(r: dict, task: str = TASK) -> tuple[float | None, str]:
    """(final mismatch gap, where from): "val" = the whole val split (posthoc.py on the final
    checkpoint), "eval" = the run's own final eval (its train.eval_batches), "diag" = the last
    diagnostics run (4 fixed batches)."""
    if (v := ((r.get("posthoc") or {}).get("eval", {}).get("mismatch_gap") or {}).get(task)) is not None:
        return v, "val"
    if (v := (r.get("mismatch_end") or {}).get(task)) is not None:
        return v, "eval"
    return (r.get("mismatch_gap") or {}).get(task), "diag"


def run_onset(r: dict, task: str = TASK) -> tuple[int | None, int | None]:
    return onset([(s, g[task]) for s, g in r.get("mismatch_curve", []) if task in g], ONSET_GAP)


def load_pool(spec: str) -> list[dict]:
    """`PATH:ARM[,ARM]` -> those arms' runs from another experiment's results.json."""
    path, _, arms = spec.rpartition(":")
    runs = json.loads(Path(path).read_text(encoding="utf-8"))["runs"]
    return [r for r in runs if r["arm"] in arms.split(",")]


def onset_summary(runs: list[dict], reads_gap: float, ref: str = "static",
                  pool: list[dict] | None = None) -> dict:
    """runs: per-run dicts with "arm". -> {"arms": {arm: row}, "ref": ..., "pooled": n}"""
    by_arm: dict[str, list[dict]] = {}
    for r in runs:
        by_arm.setdefault(r["arm"], []).append(r)
    ref_runs = by_arm.get(ref, []) + (pool or [])
    ref_events = as_events([run_onset(r) for r in ref_runs])
    ref_text = statistics.fmean(r["loss"]["text"] for r in by_arm[ref]) if ref in by_arm else None
    arms = {}
    for arm, rs in by_arm.items():
        onsets = [run_onset(r) for r in rs]
        events = as_events(onsets)
        finals = [final_mismatch(r) for r in rs]
        text = [r["loss"]["text"] for r in rs]
        chi2, p = log_rank(events, ref_events) if arm != ref and ref_events else (None, None)
        arms[arm] = {
            "seeds": len(rs), "onsets": [o for o, _ in onsets],
            "last_check": max((t for t, _ in events), default=0),
            "started": sum(o is not None for o, _ in onsets),
            "reads": sum(v is not None and v >= reads_gap for v, _ in finals),
            "final_mismatch": [v for v, _ in finals], "final_from": sorted({f for _, f in finals}),
            "km_median": km_median(events), "km": km_curve(events), "log_rank_chi2": chi2, "log_rank_p": p,
            "text_loss": statistics.fmean(text),
            "text_loss_sd": statistics.stdev(text) if len(text) > 1 else 0.0,
            "text_vs_ref": None if ref_text is None else statistics.fmean(text) - ref_text,
            "media_share": _mean([r.get("media_share") for r in rs]),
        }
    ref_row = {"seeds": len(ref_runs), "km_median": km_median(ref_events), "km": km_curve(ref_events),
               "started": sum(e for _, e in ref_events)}
    return {"ref": ref, "pooled": len(pool or []), "ref_pooled": ref_row, "threshold": ONSET_GAP,
            "reads_gap": reads_gap, "arms": arms}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def onset_md(o: dict) -> list[str]:
    head = ["arm", "media tokens", f"reads (final mismatch >= {o['reads_gap']:g})", "final mismatch image",
            "started by end", "onsets (steps; - none)", "KM median onset", f"log-rank p vs {o['ref']}",
            "text loss", f"text - {o['ref']}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, a in o["arms"].items():
        n = a["seeds"]
        finals = [v for v in a["final_mismatch"] if v is not None]
        fm = f"{statistics.fmean(finals):+.3f} ({'/'.join(a['final_from'])})" if finals else "-"
        share = "-" if a["media_share"] is None else f"{100 * a['media_share']:.1f}%"
        onsets = sorted(a["onsets"], key=lambda s: (s is None, s))
        row = [arm, share, f"{a['reads']}/{n}", fm, f"{a['started']}/{n}",
               ", ".join("-" if s is None else str(s) for s in onsets),
               "-" if a["km_median"] is None else str(a["km_median"]),
               "-" if a["log_rank_p"] is None else f"{a['log_rank_p']:.3g}",
               f"{a['text_loss']:.4f} ± {a['text_loss_sd']:.4f}",
               "-" if a["text_vs_ref"] is None else f"{a['text_vs_ref']:+.4f}"]
        lines.append("| " + " | ".join(row) + " |")
    ref = o["ref_pooled"]
    lines += ["", f"Onset: first diagnostics check (every 50 steps, 4 fixed val batches) with image mismatch "
              f"gap >= {o['threshold']} nats; runs that never reach it are censored at their last check. "
              f"KM: Kaplan-Meier median of the onset (- : fewer than half started). Log-rank against "
              f"`{o['ref']}`" + (f" pooled with {o['pooled']} runs of the earlier experiment "
                                 f"({ref['seeds']} runs, {ref['started']} started, KM median "
                                 f"{ref['km_median'] if ref['km_median'] is not None else '-'})"
                                 if o["pooled"] else "") +
              ". Final mismatch: (val) the whole val split on the final checkpoint (posthoc.py), (eval) "
              "the run's final eval, (diag) the last diagnostics run."]
    return lines


def plot_km(o: dict, path: Path) -> Path:
    """Share of runs reading (1 - KM survival) against step, one step curve per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, a in o["arms"].items():
        xs, ys = [0], [0.0]
        for t, s in a["km"]:
            xs += [t, t]
            ys += [ys[-1], 1.0 - s]
        xs.append(a["last_check"])
        ys.append(ys[-1])
        ax.plot(xs, ys, label=arm, linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel(f"share of seeds reading (mismatch >= {o['threshold']})")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
