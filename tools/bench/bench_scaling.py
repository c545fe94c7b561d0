"""What each mesh dimension saves per rank, at degrees 1, 2 and 4: `mmtrain plan`'s trace of the
trainer's own parallelize code (FSDP2, DTensor, the MoE dispatcher, the CP / TP layers, the
pipeline's stages) on torch's fake process group, under FSDPMemTracker and a collective counter.

    python -m tools.bench.bench_scaling [--dims fsdp tp pp ep cp] [--degrees 1 2 4]

Per rank (the largest over ranks for pp, whose stages differ): bytes at rest (parameters and
optimizer state; gradients follow parameters), the peak of gathered weights, the activation peak,
and the bytes sent a step by collective. The config is configs/tiny.yaml (vocab 512, 4 kv heads so
that tp 4 divides them, no visual head), each dim alone over `degree` ranks; degree 1 is one
process. tests/mmtrain/test_scaling.py asserts the ratios each dim exists for.
"""

from __future__ import annotations

import argparse

BASE = ["model.decoder.vocab_size=512", "model.decoder.n_kv_heads=4", "model.visual_head=false",
        "loss.visual_next.weight=0", "data.batch_size=4"]
DENSE8 = ["model.decoder.moe=null", "model.decoder.n_layers=8"]  # pp: a dense model, bytes follow FLOPs
DIMS = {  # dim -> overrides at degree n (the ranks are n: the dim alone)
    "fsdp": lambda n: [],
    "tp": lambda n: [f"dist.tp={n}"],
    "pp": lambda n: [f"dist.pp={n}", f"train.grad_accum={n}", *DENSE8],
    "ep": lambda n: [f"dist.ep={n}"],
    "cp": lambda n: [f"dist.cp={n}"],
}
SAME_BASELINE = {"pp": DENSE8}  # its degree 1


def measure(dim: str, n: int) -> dict:
    """{"rest", "gathered", "activations", "wire": {(group, kind): bytes}} per rank (MB are 1e6 B)."""
    from mmtrain.plan.cli import make_plan

    sets = [*BASE, *(DIMS[dim](n) if n > 1 else SAME_BASELINE.get(dim, []))]
    ranks = range(n) if dim == "pp" and n > 1 else [0]
    plans = [make_plan("configs/tiny.yaml", n, "h100", sets, rank=r) for r in ranks]
    out = []
    for plan in plans:
        mem = plan["memory"]["by_category"]
        out.append({"rest": mem.get("parameters", 0) + mem.get("optimizer state", 0),
                    "gathered": mem.get("gathered weights", 0), "activations": mem.get("activations", 0),
                    "wire": {(c["dim"], c["kind"]): c["bytes"] for c in plan["comm"]}})
    return max(out, key=lambda r: r["rest"])  # pp: the largest stage


def row(dim: str, n: int, m: dict, base: dict) -> str:
    wire = sorted(m["wire"].items(), key=lambda kv: -kv[1])[:3]
    sent = "; ".join(f"{g} {k} {b / 1e6:.2f}" for (g, k), b in wire) or "-"
    ratio = "/".join(f"{m[k] / base[k]:.2f}" if base[k] else "-" for k in ("rest", "gathered", "activations"))
    mb = " | ".join(f"{m[k] / 1e6:.2f}" for k in ("rest", "gathered", "activations"))
    return f"| {dim} | {n} | {mb} | {ratio} | {sent} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", nargs="*", default=list(DIMS))
    p.add_argument("--degrees", nargs="*", type=int, default=[1, 2, 4])
    a = p.parse_args()
    print("| dim | ranks | at rest (MB) | gathered weights peak (MB) | activations peak (MB) "
          "| x degree 1 (rest/gathered/act.) | sent a step, top 3 (MB) |")
    print("|---|---|---|---|---|---|---|")
    for dim in a.dims:
        base = measure(dim, 1)
        for n in a.degrees:
            print(row(dim, n, base if n == 1 else measure(dim, n), base), flush=True)


if __name__ == "__main__":
    main()
