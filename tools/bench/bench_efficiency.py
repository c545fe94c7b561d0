"""Kernel efficiency of a sparse layer: does it cost what it keeps?

    python -m tools.bench.bench_efficiency                       # default + long settings, 4k/16k/64k
    python -m tools.bench.bench_efficiency --settings default --seq 4096 16384 --repeats 3
    python -m tools.bench.bench_efficiency --device cuda          # flex's sparse vs full layers (bf16)
    python -m tools.bench.bench_efficiency --breakdown --settings default --seq 16384   # CPU kernel's calls

One attention layer, forward + backward, on one text document of S tokens (random q, k, v): the
fused full layer (the backend `auto` runs there: sdpa on CPU, flash / flex on CUDA) and the
sparse layer (gather on CPU, flex on CUDA), timed interleaved in one process (medians of
`--repeats` after a warm-up each). `kept` is the share of the full layer's keys the sparse layer
attends (counts.py, over every query token), and

    efficiency = t_full x kept / t_sparse

is 1.0 when the sparse layer costs exactly its share of the full layer, above 1 when less.
`select` is the selection's own share of the sparse layer's time (select_blocks alone, timed the
same way). Settings: `default` = AttentionConfig's defaults with H 4 / Hkv 2 / D 64; `long` =
configs/long.yaml's layers (H 12, Hkv 4, D 128, block 128, window 2048, top-16).
"""

from __future__ import annotations

import argparse
import statistics
import time

SETTINGS = {
    "default": {"heads": 4, "kv_heads": 2, "dim": 64, "block_size": 64, "window": 256, "top_k": 4},
    "long": {"heads": 12, "kv_heads": 4, "dim": 128, "block_size": 128, "window": 2048, "top_k": 16},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sparse-backend", default="auto", help="backend of the sparse layer (auto)")
    p.add_argument("--image-every", type=int, default=0, help="a 256-token image span every N tokens")
    p.add_argument("--breakdown", action="store_true",
                   help="CPU tile kernel: the fused calls' share of the sparse layer, pairs computed vs "
                        "kept, ns per pair by kind of call")
    return p.parse_args(argv)


def _inputs(S: int, s: dict, image_every: int, dev, dtype):
    import torch

    from mmtrain.models.attention import build_meta

    span_1S = torch.full((1, S), -1, dtype=torch.int32)
    if image_every:
        for i, start in enumerate(range(image_every // 2, S - 256, image_every)):
            span_1S[:, start:start + 256] = i
    meta = build_meta(torch.zeros(1, S, dtype=torch.int32, device=dev), span_1S.to(dev), s["block_size"])
    H, K, D = s["heads"], s["kv_heads"], s["dim"]
    qkv = [torch.randn(1, h, S, D, device=dev, dtype=dtype, requires_grad=True) for h in (H, K, K)]
    return meta, qkv, torch.randn(1, H, S, D, device=dev, dtype=dtype)


def _timer(dev):
    import torch

    def now() -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()
    return now


def measure(S: int, name: str, args) -> dict:
    """Medians of the full layer, the sparse layer and the selection, interleaved; kept share."""
    import torch

    from mmtrain.models.attention import AttentionConfig, attend, select_blocks
    from mmtrain.models.attention.counts import full_counts, sparse_counts

    dev = torch.device(args.device)
    s = SETTINGS[name]
    meta, (q, k, v), dout = _inputs(S, s, args.image_every, dev, torch.bfloat16 if dev.type == "cuda" else
                                    torch.float32)
    knobs = {key: s[key] for key in ("block_size", "window", "top_k")}
    full_cfg = AttentionConfig(**knobs)
    sparse_cfg = AttentionConfig(backend=args.sparse_backend, **knobs)
    now = _timer(dev)

    def layer(cfg, sparse):
        def run():
            q.grad = k.grad = v.grad = None
            t0 = now()
            attend(q, k, v, meta, cfg, sparse=sparse).backward(dout)
            return now() - t0
        return run

    def select():
        with torch.no_grad():
            t0 = now()
            select_blocks(q, k, meta, sparse_cfg)
            return now() - t0

    runs = {"full": layer(full_cfg, False), "sparse": layer(sparse_cfg, True), "select": select}
    times = {key: [] for key in runs}
    for r in range(args.repeats + 1):
        for key, fn in runs.items():
            t = fn()
            if r:  # the first round warms up (and compiles flex on CUDA)
                times[key].append(t)
    with torch.no_grad():
        sel = select_blocks(q, k, meta, sparse_cfg)
        kept = float(sparse_counts(meta, sparse_cfg, sel)["keys"] / full_counts(meta)["keys"])
    med = {key: statistics.median(ts) for key, ts in times.items()}
    return {**med, "kept": kept, "efficiency": med["full"] * kept / med["sparse"],
            "select_share": med["select"] / med["sparse"]}


def breakdown(S: int, name: str, args) -> dict:
    """Where the CPU tile kernel's time goes: the sparse layer's fwd+bwd (median of `--repeats` after
    a warm-up) with its fused calls timed one by one (tiles._FWD / _BWD wrapped), grouped by kind
    ("plain": no mask, "bias": an additive mask, "causal") and direction; `computed` counts the
    query-key pairs the calls evaluate (masked ones included), `kept` those the rule keeps."""
    import collections

    import torch

    from mmtrain.models.attention import AttentionConfig, attend, select_blocks, tiles
    from mmtrain.models.attention.counts import sparse_counts

    s = SETTINGS[name]
    meta, (q, k, v), dout = _inputs(S, s, args.image_every, torch.device("cpu"), torch.float32)
    cfg = AttentionConfig(block_size=s["block_size"], window=s["window"], top_k=s["top_k"])
    secs, calls, pairs = collections.Counter(), collections.Counter(), collections.Counter()

    def timed(op, direction, first_q, causal_at):
        def call(*a, attn_mask=None, scale=None):
            q_, k_, causal = a[first_q], a[first_q + 1], a[causal_at]
            kind = (direction, "causal" if causal else "plain" if attn_mask is None else "bias")
            t0 = time.perf_counter()
            out = op(*a, attn_mask=attn_mask, scale=scale)
            secs[kind] += time.perf_counter() - t0
            calls[kind] += 1
            pairs[kind] += q_.shape[0] * q_.shape[1] * q_.shape[2] * k_.shape[2]
            return out
        return call

    def run() -> float:
        q.grad = k.grad = v.grad = None
        t0 = time.perf_counter()
        attend(q, k, v, meta, cfg, sparse=True).backward(dout)
        return time.perf_counter() - t0

    fwd, bwd = tiles._FWD, tiles._BWD
    run()  # warm-up, untimed
    tiles._FWD, tiles._BWD = timed(fwd, "fwd", 0, 4), timed(bwd, "bwd", 1, 7)
    try:
        total = statistics.median(run() for _ in range(max(1, args.repeats)))
    finally:
        tiles._FWD, tiles._BWD = fwd, bwd
    n = max(1, args.repeats)
    with torch.no_grad():
        kept = float(sparse_counts(meta, cfg, select_blocks(q, k, meta, cfg))["keys"]) * s["heads"]
    computed = sum(p for (d, _), p in pairs.items() if d == "fwd") / n
    return {"total": total, "kernel": sum(secs.values()) / n, "computed": computed, "kept": kept,
            "kinds": {kind: (calls[kind] // n, secs[kind] / n, pairs[kind] / n) for kind in sorted(secs)}}


def print_breakdown(name: str, S: int, r: dict) -> None:
    print(f"\n{name} S={S}: sparse layer {r['total'] * 1e3:.1f} ms, fused calls {r['kernel'] * 1e3:.1f} ms "
          f"({r['kernel'] / r['total']:.0%}); pairs computed / kept {r['computed'] / r['kept']:.3f}")
    print("| call | kind | calls | ms | pairs (M) | ns / pair |")
    print("|---|---|---|---|---|---|")
    for (direction, kind), (n, sec, p) in r["kinds"].items():
        ns = sec * 1e9 / max(p, 1)
        print(f"| {direction} | {kind} | {n} | {sec * 1e3:.1f} | {p / 1e6:.1f} | {ns:.2f} |")


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.breakdown:
        for name in args.settings:
            for S in args.seq:
                print_breakdown(name, S, breakdown(S, name, args))
        return
    print(f"one layer fwd+bwd, one text document, {args.device}, {args.threads} threads, "
          f"medians of {args.repeats} (efficiency = t_full x kept / t_sparse)\n")
    print("| settings | S | full (s) | sparse (s) | kept | efficiency | sparse / full | select share |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.settings:
        for S in args.seq:
            r = measure(S, name, args)
            cells = (f"{r['full']:.3f}", f"{r['sparse']:.3f}", f"{r['kept']:.3f}", f"{r['efficiency']:.2f}",
                     f"{r['sparse'] / r['full']:.2f}", f"{r['select_share']:.1%}")
            print(f"| {name} | {S} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
