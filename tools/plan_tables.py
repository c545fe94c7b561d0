"""docs/DISTRIBUTED.md's memory and traffic tables, from `mmtrain plan --json` (mmtrain/plan/).

    python -m tools.plan_tables                                  # print the tables
    python -m tools.plan_tables --write docs/DISTRIBUTED.md      # replace them between the markers

Each row is `mmtrain plan CONFIG --gpus N --gpu h100 --set ...` (the command is printed
beside the table); the plan's defaults: half of each row's tokens image tokens, uniform routing.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- plan-tables:begin -->", "<!-- plan-tables:end -->"
GPU = "h100"
ROWS = [  # (config, gpus, --set pairs): each config at its intended mesh
    ("small", 1, []), ("small", 8, []),
    ("base", 32, ["dist.dp_replicate=4"]), ("base", 64, ["dist.dp_replicate=8"]),
    ("base", 64, ["dist.dp_replicate=8", "dist.activation_checkpointing=false"]),  # why it is on
    ("long", 256, ["dist.dp_replicate=32", "dist.cp=2"]),  # its 64k-token rows
    # 1M-token rows: cp 32 keeps a rank's chunk at 32k tokens, as cp 2 does at 64k
    ("long", 256, ["dist.dp_replicate=8", "dist.cp=32", "data.seq_len=1048576"]),
    ("m3", 256, []),
    # M3's published mesh, TP2 / PP4 / EP32 (16 micro-batches), and PP4 x EP32 without the TP
    ("m3", 256, ["dist.pp=4", "dist.ep=32", "train.grad_accum=16"]),
    ("m3", 256, ["dist.tp=2", "dist.pp=4", "dist.ep=32", "train.grad_accum=16"]),
]
SMALL_ROWS = [("tiny", 2, []), ("video_heavy", 2, [])]  # the test configs: planned (CI), not tabled
GB = 1e9
GIB = 2**30


def command(name: str, gpus: int, sets: list[str]) -> str:
    head = f"mmtrain plan configs/{name}.yaml --gpus {gpus} --gpu {GPU}"
    return " ".join([head, *(f"--set {s}" for s in sets)])


def plans(rows=None, seconds: list | None = None) -> list[tuple[str, dict]]:
    """[(command, plan)] of `rows` (default ROWS); `seconds` gets each plan's CPU seconds."""
    import time

    from mmtrain.plan.cli import make_plan

    out = []
    for n, g, s in ROWS if rows is None else rows:
        start = time.process_time()
        out.append((command(n, g, s), make_plan(str(REPO / "configs" / f"{n}.yaml"), g, GPU, s)))
        if seconds is not None:
            seconds.append(time.process_time() - start)
    return out


def _mesh(plan: dict) -> str:
    m = plan["mesh"]
    parts = [f"{k} {v}" for k, v in m.items() if v > 1]
    return ", ".join(parts) or "one rank"


def memory_table(rows: list[tuple[str, dict]]) -> list[str]:
    cats = ("parameters", "gradients", "optimizer state", "gathered weights", "activations", "temporaries")
    out = ["| command | mesh | tokens / GPU | " + " | ".join(cats) + " | peak (GiB) | fits 80 GiB - 6 |",
           "|---|---|---|" + "---|" * len(cats) + "---|---|"]
    for cmd, p in rows:
        mem = p["memory"]
        cells = [f"{mem['by_category'].get(c, 0) / GIB:.2f}" for c in cats]
        out.append(f"| `{cmd}` | {_mesh(p)} | {p['batch']['tokens_per_rank']:,} | " + " | ".join(cells)
                   + f" | **{mem['peak_bytes'] / GIB:.2f}** | {'yes' if mem['fits'] else 'NO'} |")
    return out


def traffic_table(rows: list[tuple[str, dict]]) -> list[str]:
    out = ["| command | collectives per step: group kind GB (calls) | across nodes (GB) | compute (s) | "
           "step, overlapped .. serial (s) | MFU at that step |", "|---|---|---|---|---|---|"]
    for cmd, p in rows:
        comm = "; ".join(f"{c['dim']} {c['kind']} {c['bytes'] / GB:.2f} ({c['calls']})" for c in p["comm"]
                         if c["bytes"] >= 1e6)
        across = sum(c["bytes"] for c in p["comm"] if c["across_nodes"]) / GB
        r = p["roofline"]
        out.append(f"| `{cmd}` | {comm or '-'} | {across:.2f} | {r['compute_s']:.3f} | "
                   f"{r['step_s_overlapped']:.3f} .. {r['step_s_serial']:.3f} | "
                   f"{r['mfu_overlapped']:.0%} .. {r['mfu_serial']:.0%} |")
    return out


def flops_table(rows: list[tuple[str, dict]]) -> list[str]:
    names = list(dict.fromkeys(n for _, p in rows for n in p["flops"]["by_component"]))
    out = ["| command | " + " | ".join(names) + " | model TFLOP / GPU / step |",
           "|---|" + "---|" * (len(names) + 1)]
    for cmd, p in rows:
        f = p["flops"]
        cells = [f"{f['by_component'].get(n, 0) / max(f['hardware'], 1):.0%}" for n in names]
        out.append(f"| `{cmd}` | " + " | ".join(cells) + f" | {f['model'] / 1e12:.1f} |")
    return out


def tables(rows: list[tuple[str, dict]] | None = None) -> str:
    """The block between the markers, from `rows` (default: plan every row now)."""
    rows = plans() if rows is None else rows
    return "\n".join([BEGIN, "Memory per GPU at the step's peak (GiB):", "", *memory_table(rows), "",
                      "Collectives per GPU and step, roofline step time and MFU on H100 specs:", "",
                      *traffic_table(rows), "", "FLOPs per GPU and step by component (share of the "
                      "hardware FLOPs; `recompute`: activation checkpointing's second forward):", "",
                      *flops_table(rows), END])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", help="a Markdown file whose plan-tables block is replaced")
    args = ap.parse_args(argv)
    text = tables()
    if not args.write:
        print(text)
        return
    path = Path(args.write)
    doc = path.read_text(encoding="utf-8")
    if BEGIN not in doc:
        raise SystemExit(f"{path}: no {BEGIN} marker")
    path.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: text, doc, flags=re.S),
                    encoding="utf-8")


if __name__ == "__main__":
    main()
