"""Collect the runs of an experiment into one table (mean and spread over seeds) and plots.

Per run: the final val losses and reliance gaps (summary.json: the whole val split), the final
text->visual attention mass and the reliance-gap curve (diagnostics.jsonl), the final weights.
A media task *collapses* in a run when its final reliance gap is below the experiment's
`collapse_gap`: its text no longer reads the pixels.
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from mmtrain.data_pipelines.batch import MEDIA_TASKS, TASK_NAMES
from tools.experiments.onset_report import final_mismatch, onset_md, plot_km

SHORT = {"text": "text", "image_text": "image", "video_text": "video"}


LATE_STEP = 100  # "late" collapse view: diagnostics points after this step with a gap below collapse_gap


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_run(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    diags = _jsonl(run_dir / "diagnostics.jsonl")
    steps = {r["step"]: r for r in _jsonl(run_dir / "metrics.jsonl") if "eval" not in r}  # last line wins
    end = summary["end"]
    last = diags[-1] if diags else {}
    return {
        "loss": end["loss"], "gap": end["reliance_gap"], "weights": summary.get("weights", {}),
        "attn_mass": {t: _layer_mean(a.get("mass")) for t, a in last.get("attention", {}).items()},
        "effective_rank": last.get("effective_rank", {}),
        "curve": [(d["step"], d.get("reliance_gap", {})) for d in diags],
        "mismatch_curve": [(d["step"], d["mismatch_gap"]) for d in diags if "mismatch_gap" in d],
        "mismatch_gap": last.get("mismatch_gap", {}),
        "mismatch_end": end.get("mismatch_gap", {}),  # the final eval's, whole val split (when logged)
        "probe": last.get("probe") or {},
        "parts": _parts_curve(steps),
        "media_tokens_per_step": _per_step(steps.values(), MEDIA_TASKS),
        "pointing": _pointing(last.get("pointing") or {}),
        "pointing_attn": _attn_pointing(run_dir / "attn" / "metrics.json"),
        "media_share": _media_share(steps.values()),
        "share_curve": [(s, 1.0 - r["mix"]["text"]) for s, r in sorted(steps.items())
                        if "mix" in r and "text" in r["mix"] and s % 10 == 0],
        "mix_mean": _mix_mean(steps.values()),
        "step_s": statistics.fmean(r["step_s"] for r in steps.values()) if steps else None,
        "tw_s": _mean_of(r.get("token_weighting", {}).get("seconds") for r in steps.values()),
        "diag_mismatch_s": _mean_of(d.get("seconds", {}).get("mismatch") for d in diags),
        "mix": summary.get("mix"),
        "alarms": sum(len(d.get("alarms", [])) for d in diags),
        "tokens": summary["tokens_seen"], "steps": summary["steps"],
    }


def _per_step(records, tasks) -> float | None:
    """Mean trained tokens of `tasks` per optimizer step."""
    counts = [r["task_tokens"] for r in records if "task_tokens" in r]
    return sum(c.get(t, 0) for c in counts for t in tasks) / len(counts) if counts else None


def _parts_curve(steps: dict[int, dict]) -> list[dict]:
    """Per-part gradient norms and update ratios (grad_norm/<part>, update_ratio/<part>) on log steps."""
    keys = ("grad_norm/", "update_ratio/")
    return [{"step": s, **{k: v for k, v in r.items() if k.startswith(keys)}}
            for s, r in sorted(steps.items()) if any(k.startswith(keys) for k in r)]


def _mean_of(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _pointing(p: dict) -> float | None:
    """Pointing-game accuracy over the categories, weighted by their words."""
    n = sum(c["n"] for c in p.values())
    return sum(c["accuracy"] * c["n"] for c in p.values()) / n if n else None


def _attn_pointing(path: Path) -> float | None:
    """`mmtrain-attn --from-val`'s pointing game: accuracy of the mean-over-layers map, all words."""
    if not path.exists():
        return None
    game = json.loads(path.read_text(encoding="utf-8")).get("pointing_game") or {}
    return ((game.get("token") or {}).get("summary") or {}).get("all", {}).get("accuracy_mean_layers")


def _media_share(records) -> float | None:
    """Share of the trained tokens that belong to media tasks, over the whole run."""
    counts = [r["task_tokens"] for r in records if "task_tokens" in r]
    total = sum(sum(c.values()) for c in counts)
    return sum(c.get(t, 0) for c in counts for t in MEDIA_TASKS) / total if total else None


def _mix_mean(records) -> dict[str, float] | None:
    """The controller's document shares averaged over the steps (what a matched fixed mix uses)."""
    mixes = [r["mix"] for r in records if "mix" in r]
    return {n: statistics.fmean(m[n] for m in mixes) for n in mixes[0]} if mixes else None


def late_low_share(curve: list, task: str, gap: float) -> float | None:
    """Share of the diagnostics points after LATE_STEP whose gap is below `gap` (the late view of
    collapse: a run that recovers only at the very end still spent most of its time collapsed)."""
    pts = [g[task] for step, g in curve if step > LATE_STEP and task in g]
    return sum(v < gap for v in pts) / len(pts) if pts else None


def _layer_mean(values: list | None) -> float | None:
    values = [v for v in values or [] if v is not None]
    return sum(values) / len(values) if values else None


def _stats(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "sd": sd, "min": min(values), "max": max(values),
            "n": len(values)}


def summarize_runs(runs, exp) -> dict:
    """-> {"arms": {arm: {metric: {task: stats}}, "collapsed": {task: k}}, "runs": [...]}"""
    by_arm: dict[str, list[dict]] = {}
    per_run = []
    for run in runs:
        r = run.read()
        by_arm.setdefault(run.arm, []).append(r)
        per_run.append({"arm": run.arm, "seed": run.seed, **{k: v for k, v in r.items() if k != "curve"}})
    arms = {}
    for arm, rs in by_arm.items():
        arms[arm] = {
            "seeds": len(rs),
            "tokens": rs[0]["tokens"],
            "loss": {t: _stats([r["loss"].get(t) for r in rs]) for t in TASK_NAMES},
            "gap": {t: _stats([r["gap"].get(t) for r in rs]) for t in MEDIA_TASKS},
            "attn_mass": {t: _stats([r["attn_mass"].get(t) for r in rs]) for t in MEDIA_TASKS},
            "weights": {t: _stats([r["weights"].get(t) for r in rs]) for t in TASK_NAMES},
            "collapsed": {t: sum(r["gap"].get(t, 0.0) < exp.collapse_gap for r in rs) for t in MEDIA_TASKS},
            "mismatch_end": {t: _stats([_final_mismatch(r, t) for r in rs]) for t in MEDIA_TASKS},
            "reads": {t: sum((_final_mismatch(r, t) or 0.0) >= exp.collapse_gap for r in rs)
                      for t in MEDIA_TASKS},
            "late_low": {t: _stats([late_low_share(r["curve"], t, exp.collapse_gap) for r in rs])
                         for t in MEDIA_TASKS},
            "mismatch_gap": {t: _stats([r["mismatch_gap"].get(t) for r in rs]) for t in MEDIA_TASKS},
            "pointing": _stats([r["pointing"] for r in rs]),
            "pointing_attn": _stats([r["pointing_attn"] for r in rs]),
            "media_share": _stats([r["media_share"] for r in rs]),
            "mix_mean": _mean_dicts([r["mix_mean"] for r in rs]),
            "step_s": _stats([r["step_s"] for r in rs]),
            "tw_s": _stats([r["tw_s"] for r in rs]),
            "diag_mismatch_s": _stats([r["diag_mismatch_s"] for r in rs]),
            "restart_s": _stats([(r["mix"] or {}).get("restart_s") for r in rs]),
            "seed_shares": [r["share_curve"] for r in rs],
            "seed_mismatch": [{t: [(step, g[t]) for step, g in r["mismatch_curve"] if t in g]
                               for t in MEDIA_TASKS} for r in rs],
            "curve": _mean_curve([r["curve"] for r in rs]),
            "seed_curves": [{t: [(step, g[t]) for step, g in r["curve"] if t in g] for t in MEDIA_TASKS}
                            for r in rs],
        }
    return {"collapse_gap": exp.collapse_gap, "notes": exp.notes, "arms": arms, "runs": per_run}


def _final_mismatch(r: dict, task: str) -> float | None:
    return final_mismatch(r, task)[0]


def _mean_dicts(dicts: list[dict | None]) -> dict[str, float] | None:
    dicts = [d for d in dicts if d]
    return {k: statistics.fmean(d[k] for d in dicts) for k in dicts[0]} if dicts else None


def _mean_curve(curves: list[list]) -> dict[str, list[tuple[int, float]]]:
    """Reliance gap per task against step, averaged over the seeds that have that step."""
    out = {}
    for task in MEDIA_TASKS:
        points: dict[int, list[float]] = {}
        for curve in curves:
            for step, gaps in curve:
                if task in gaps:
                    points.setdefault(step, []).append(gaps[task])
        out[task] = [(s, statistics.fmean(v)) for s, v in sorted(points.items())]
    return out


def _ms(s: dict | None, signed: bool = False) -> str:
    if s is None:
        return "-"
    mean = f"{s['mean']:+.3f}" if signed else f"{s['mean']:.3f}"
    return f"{mean} ± {s['sd']:.3f}"


def table_md(results: dict) -> str:
    head = ["arm", "seeds", "loss text", "loss image", "loss video", "mismatch gap image",
            "mismatch gap video", "reads (i/v)", "blanked gap image", "blanked gap video",
            "attn mass image", "attn mass video", "weights end (t/i/v)", "blanked < gap (i/v)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, a in results["arms"].items():
        w = "/".join("-" if a["weights"][t] is None else f"{a['weights'][t]['mean']:.2f}" for t in TASK_NAMES)
        n = a["seeds"]
        reads = a.get("reads") or {}
        row = [arm, str(n), *(_ms(a["loss"][t]) for t in TASK_NAMES),
               *(_ms((a.get("mismatch_end") or {}).get(t), signed=True) for t in MEDIA_TASKS),
               ", ".join(f"{reads[t]}/{n}" if t in reads else "-" for t in MEDIA_TASKS),
               *(_ms(a["gap"][t], signed=True) for t in MEDIA_TASKS),
               *(_ms(a["attn_mass"][t]) for t in MEDIA_TASKS), w,
               f"{a['collapsed']['image_text']}/{n}, {a['collapsed']['video_text']}/{n}"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append(f"Values: mean ± sd over seeds, at the end of training, on the val split (losses and "
                 f"gaps in nats). A run reads the pixels of a media task when its final mismatch gap (own "
                 f"vs another document's media; the final eval's on the whole val split where logged, else "
                 f"the last diagnostics run's) is at least {results['collapse_gap']} nats: the verdict. "
                 f"The blanked gap (media set to flat grey) is out of distribution and shown beside it.")
    for arm, note in results.get("notes", {}).items():
        if arm in results["arms"]:
            lines.append(f"- `{arm}`: {note}")
    if any(a["media_share"] for a in results["arms"].values()):
        lines += ["", *signals_md(results)]
    if results.get("onset"):
        lines += ["", "Onset of reading:", "", *onset_md(results["onset"])]
    return "\n".join(lines) + "\n"


def _pct(s: dict | None) -> str:
    return "-" if s is None else f"{100 * s['mean']:.1f}% ± {100 * s['sd']:.1f}"


def _sec(s: dict | None) -> str:
    return "-" if s is None else f"{s['mean']:.3f}"


def signals_md(results: dict) -> list[str]:
    """The second table: the late view of collapse, the mismatch gap, the media-token share, the
    pointing game and what each mechanism costs."""
    head = ["arm", "gap<0.05 after step 100 (i / v)", "mismatch gap image", "mismatch gap video",
            "media-token share", "pointing (diag)", "pointing (mmtrain-attn)", "step s",
            "token weighting s/step", "diag mismatch s/run",
            "loader restarts s/run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, a in results["arms"].items():
        late = " / ".join(_pct(a["late_low"][t]) for t in MEDIA_TASKS)
        row = [arm, late, *(_ms(a["mismatch_gap"][t], signed=True) for t in MEDIA_TASKS),
               _pct(a["media_share"]), _ms(a["pointing"]), _ms(a["pointing_attn"]), _sec(a["step_s"]),
               _sec(a["tw_s"]),
               _sec(a["diag_mismatch_s"]), _sec(a["restart_s"])]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", f"Late view: share of the diagnostics points after step {LATE_STEP} whose (blanked) "
              "reliance gap is below the collapse threshold, mean ± sd over seeds. Mismatch gap: loss "
              "with another document's media minus with its own, last diagnostics run. Media-token "
              "share: media-task tokens / trained tokens over the run. Pointing: pointing-game accuracy "
              "(mean-over-layers maps) of the last diagnostics run (8 val media) and of `mmtrain-attn "
              "--from-val` on the final checkpoint (all words; `--attn N`). Costs are wall seconds, "
              "two runs sharing the 2-core machine."]
    return lines


def plot_curves(results: dict, out: Path, key: str = "seed_curves", label: str = "reliance gap",
                stem: str = "reliance_gap") -> list[Path]:
    """Per media task: one panel per arm, one line per seed (a mean would hide which seeds collapse).
    `key`: which per-seed curves (seed_curves: the blanked gap; seed_mismatch: the mismatch gap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {a: v for a, v in results["arms"].items()
            if any(c[t] for c in v.get(key, []) for t in MEDIA_TASKS)}
    paths = []
    for task in MEDIA_TASKS:
        if not any(c[task] for a in arms.values() for c in a[key]):
            continue
        cols = min(3, len(arms))
        rows = -(-len(arms) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.6 * rows), sharex=True, sharey=True,
                                 squeeze=False)
        for ax, (arm, a) in zip(axes.flat, arms.items()):
            for i, curve in enumerate(a[key]):
                pts = curve[task]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linewidth=1, label=f"seed {i}")
            ax.axhline(results["collapse_gap"], color="grey", linestyle=":", linewidth=1)
            ax.set_title(arm, fontsize=10)
        for ax in axes.flat[len(arms):]:
            ax.axis("off")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{label} {SHORT[task]} (nats, diagnostics set) against step, per seed")
        fig.tight_layout()
        path = out / f"{stem}_{task}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_shares(results: dict, out: Path) -> list[Path]:
    """Media document share (1 - text share) against step, per seed, for the controlled arms."""
    arms = {a: v for a, v in results["arms"].items() if any(v.get("seed_shares", []))}
    if not arms:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(arms), figsize=(4 * len(arms), 2.8), sharey=True, squeeze=False)
    for ax, (arm, a) in zip(axes.flat, arms.items()):
        for i, curve in enumerate(a["seed_shares"]):
            ax.plot([p[0] for p in curve], [p[1] for p in curve], linewidth=1, label=f"seed {i}")
        ax.set_title(arm, fontsize=10)
    axes[0][0].set_ylabel("media document share")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = out / "media_share.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [path]


def plot_final(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(results["arms"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(TASK_NAMES)
    for i, task in enumerate(TASK_NAMES):
        stats = [results["arms"][a]["loss"][task] for a in arms]
        axes[0].bar([x + i * width for x in range(len(arms))], [s["mean"] if s else 0 for s in stats], width,
                    yerr=[s["sd"] if s else 0 for s in stats], label=SHORT[task])
    width = 0.8 / len(MEDIA_TASKS)
    for i, task in enumerate(MEDIA_TASKS):
        stats = [results["arms"][a]["gap"][task] for a in arms]
        axes[1].bar([x + i * width for x in range(len(arms))], [s["mean"] if s else 0 for s in stats], width,
                    yerr=[s["sd"] if s else 0 for s in stats], label=SHORT[task])
    axes[1].axhline(results["collapse_gap"], color="grey", linestyle=":", linewidth=1)
    for ax, title in zip(axes, ("final val loss (nats)", "final reliance gap (nats)")):
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(arms))], arms, rotation=30, ha="right")
        ax.set_title(title)
        ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_outputs(results: dict, out: Path, report: Path | None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "table.md"]
    written[0].write_text(json.dumps(results, indent=2), encoding="utf-8")
    written[1].write_text(table_md(results), encoding="utf-8")
    written += [*plot_curves(results, out), plot_final(results, out / "final.png")]
    written += plot_curves(results, out, "seed_mismatch", "mismatch gap", "mismatch_gap")
    written += plot_shares(results, out)
    if results.get("onset"):
        written.append(plot_km(results["onset"], out / "onset_km.png"))
    if report is not None:
        report.mkdir(parents=True, exist_ok=True)
        for path in written:
            shutil.copy(path, report / path.name)
    return written
