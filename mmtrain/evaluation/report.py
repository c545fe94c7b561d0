"""The end-of-run tables: per-modality loss at the start and the end, whether the text reads the pixels
(the mismatch gap, the verdict) beside the blanked reliance gap; the captioning eval's attribute
accuracies (when it ran)."""

from __future__ import annotations

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from mmtrain.data_pipelines.batch import TASK_NAMES

SUMMARY_CAPTION = (
    "reads pixels (the verdict): mismatch gap, val loss with each document's media swapped for another "
    "document's minus with its own, on the swapped documents' tokens (nats; ~0: the text ignores the "
    "pixels). "
    "blanked gap: val loss with media set to flat grey minus with real media (out of distribution)")


def summary_table(summary: dict) -> Table:
    start, end = summary["start"], summary["end"]
    weights = summary.get("weights") or {}
    table = Table(title=f"{summary['run_dir']}: step {start['step']} -> {end['step']} (val split); "
                        f"balancer {summary.get('balancer', 'static')}")
    for col in ("modality", "loss start", "loss end", "acc end", "reads pixels start", "reads pixels end",
                "blanked gap start", "blanked gap end", "weight end"):
        table.add_column(col, justify="left" if col == "modality" else "right", no_wrap=col == "modality")
    table.caption = SUMMARY_CAPTION
    for task in TASK_NAMES:
        if task not in end["loss"]:
            continue
        gaps = [record.get(key, {}).get(task) for key in ("mismatch_gap", "reliance_gap")
                for record in (start, end)]
        table.add_row(
            task,
            f"{start['loss'].get(task, float('nan')):.3f}",
            f"{end['loss'][task]:.3f}",
            f"{end['accuracy'][task]:.1%}",
            *("-" if gap is None else f"{gap:+.3f}" for gap in gaps),
            f"{weights[task]:.2f}" if task in weights else "-",
        )
    return table


def caption_table(summary: dict) -> Table | None:
    """Attribute accuracy of greedy val captions, start and end, and with the media blanked."""
    start, end = summary["start"].get("captions"), summary["end"].get("captions")
    if not end:
        return None
    table = Table(title=f"captions of {end['prompts']} val images and videos (greedy)")
    for col in ("attribute", "words", "acc start", "acc end", "blank end", "gap end"):
        table.add_column(col, justify="left" if col == "attribute" else "right", no_wrap=True)
    table.caption = "gap: generation reliance gap, accuracy with real media minus with media blanked"
    for attr, acc in end["accuracy"].items():
        acc_s = (start or {}).get("accuracy", {}).get(attr)
        table.add_row(attr, str(end["words"][attr]), "-" if acc_s is None else f"{acc_s:.1%}", f"{acc:.1%}",
                      f"{end['blank_accuracy'][attr]:.1%}", f"{end['gap'][attr]:+.1%}")
    return table


def report_console(*tables: Table) -> Console:
    """A console that never cuts these tables: without a terminal (a pipe, `tee`, a SLURM log) rich
    would render at 80 columns and elide the gap columns to `+0.0…`, so it gets the width they need,
    and lines of text are not folded."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console.soft_wrap = True
        unbounded = console.options.update_width(1 << 16)
        needed = [Measurement.get(console, unbounded, t).maximum for t in tables]
        console.width = max([console.width, *needed])
    return console


def print_summary(summary: dict, seconds: float | None = None) -> None:
    tables = [t for t in (summary_table(summary), caption_table(summary)) if t is not None]
    console = report_console(*tables)
    for table in tables:
        console.print(table)
    extra = f" in {seconds / 60:.1f} min" if seconds is not None else ""
    console.print(
        f"{summary['steps']} steps, {summary['tokens_seen']:,} tokens{extra}; "
        f"data wait {summary['data_wait_fraction']:.1%} of step time; "
        f"skipped steps {summary['skipped_steps']}; checkpoint {summary['checkpoint']}"
    )
    spent = summary.get("time_s")
    if spent and seconds:  # what the wall time went to (the ETA's events, mmtrain/loop/eta.py)
        parts = {**spent, "start-up": seconds - summary.get("wall_s", seconds) + 0.0}
        parts["other"] = seconds - sum(parts.values())
        console.print("time: " + ", ".join(f"{k} {v:.0f} s ({v / seconds:.0%})" for k, v in parts.items()))
    sparse = {i: a for i, a in (summary.get("attention") or {}).items() if a["sparse"]}
    if sparse:
        kept = ", ".join(f"L{i} {a['kept_frac']:.0%}" for i, a in sparse.items())
        console.print(f"sparse layers keep {kept} of the key blocks their queries can reach (last log step)")
    diag = summary.get("diagnostics")
    if diag:
        alarms = diag.get("alarms") or []
        console.print(f"diagnostics @ {diag['step']}: " + ("; ".join(alarms) if alarms else "no alarms"))
        if diag.get("pointing"):
            parts = [f"{c} {p['accuracy']:.2f} (random token {p['chance_cell']:.2f}, {p['n']} words)"
                     for c, p in diag["pointing"].items()]
            console.print("pointing game of caption words: " + ", ".join(parts))
