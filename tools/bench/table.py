"""The ratio table the A/B benches print: median ms per side and the speed against a reference side."""

from __future__ import annotations

import statistics


def print_ratio_table(what: str, unit: str, times: dict[str, list[float]], reference: str) -> None:
    """times: side -> seconds per timed step; a row per side, `reference` is 1.00x."""
    base = statistics.median(times[reference])
    print(f"| {what} | ms / {unit} | vs {reference} |")
    print("|---|---|---|")
    for side, ts in times.items():
        print(f"| {side} | {statistics.median(ts) * 1e3:.2f} | {base / statistics.median(ts):.2f}x |")
