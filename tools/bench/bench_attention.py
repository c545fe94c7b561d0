"""Benchmark: sparse attention backends vs the dense reference, forward + backward.

    python -m tools.bench.bench_attention                         # S = 4k, 16k, 32k on CPU
    python -m tools.bench.bench_attention --seq 4096 8192 --repeats 3
    python -m tools.bench.bench_attention --max-seq --budget-gib 24  # longest trainable S per backend
    python -m tools.bench.bench_attention --device cuda           # adds flex (bf16 by default)

Every (backend, S) runs in its own subprocess so that an out-of-memory probe cannot take the bench
down. What "peak memory" measures:
  * CPU: the process's peak resident set size (getrusage ru_maxrss) minus its resident size just
    before the first attention call (inputs and selection-free state already allocated): the extra
    RAM the attention forward + backward needed at its high-water mark (allocator caching included).
    The child's address space is capped (RLIMIT_AS) at its size before the call + the budget, so a
    config over the budget fails with an allocation error instead of swapping or OOM-killing.
  * CUDA: torch.cuda.max_memory_allocated() minus the allocated bytes before the call; the budget
    is enforced with set_per_process_memory_fraction.
Times are the median wall time of `--repeats` forward+backward steps after one warm-up step
(which also compiles flex on CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

GiB = 1024**3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--backends", nargs="+", default=None, help="default: gather dense (+ flex on cuda)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="cpu: fp32, cuda: bf16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--full", action="store_true", help="full (non-sparse) layers instead of sparse")
    p.add_argument("--image-every", type=int, default=0,
                   help="insert a 256-token image span every N tokens (0: text only, one document)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--budget-gib", type=float, default=24.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per subprocess")
    p.add_argument("--max-seq", action="store_true", help="find the longest S each backend trains in budget")
    p.add_argument("--max-seq-start", type=int, default=4096)
    p.add_argument("--max-seq-limit", type=int, default=1 << 20)
    p.add_argument("--bisect-steps", type=int, default=2)
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.backends = args.backends or (["gather", "dense"] + (["flex"] if args.device == "cuda" else []))
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def child(args, backend: str, S: int) -> dict:
    """One (backend, S): build inputs, warm up, time fwd+bwd, report peak memory."""
    import torch

    from models.attention import AttentionConfig, attend, build_meta

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    doc_BS = torch.zeros(args.batch, S, dtype=torch.int32)
    span_BS = torch.full((args.batch, S), -1, dtype=torch.int32)
    if args.image_every:
        for i, start in enumerate(range(args.image_every // 2, S - 256, args.image_every)):
            span_BS[:, start:start + 256] = i
    meta = build_meta(doc_BS.to(dev), span_BS.to(dev), args.block)
    B, H, K, D = args.batch, args.heads, args.kv_heads, args.dim
    q = torch.randn(B, H, S, D, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(B, K, S, D, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(B, K, S, D, device=dev, dtype=dtype, requires_grad=True)
    dout = torch.randn(B, H, S, D, device=dev, dtype=dtype)
    cfg = AttentionConfig(backend=backend, block_size=args.block, window=args.window, top_k=args.top_k)

    def step():
        q.grad = k.grad = v.grad = None
        attend(q, k, v, meta, cfg, sparse=not args.full).backward(dout)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    if dev.type == "cuda":
        torch.cuda.synchronize()
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_gib * GiB / total))
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_bytes()
        budget = int(args.budget_gib * GiB) + _vm_bytes()
        resource.setrlimit(resource.RLIMIT_AS, (budget, budget))
    times = []
    for _ in range(args.repeats + 1):  # the first is the warm-up (its time is kept only if repeats == 0)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times = times[1:] or times
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"ok": True, "time_s": statistics.median(times), "peak_gib": peak / GiB}


def probe(args, backend: str, S: int) -> dict:
    """One max-seq probe, reported as it finishes (so a killed bench still leaves its findings)."""
    r = run_one(args, backend, S, repeats=0)
    state = f"ok, peak {r['peak_gib']:.2f} GiB, {r['time_s']:.1f} s" if r["ok"] else r["why"]
    print(f"#   probe {backend} S={S}: {state}", flush=True)
    return r


def run_one(args, backend: str, S: int, repeats: int | None = None) -> dict:
    argv = [a for a in sys.argv[1:] if a != "--max-seq"]
    if repeats is not None:
        argv += ["--repeats", str(repeats)]
    cmd = [sys.executable, "-m", "tools.bench.bench_attention", *argv, "--_child", f"{backend}:{S}"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "why": f"timeout > {args.timeout:.0f}s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode == 0 and lines:
        return json.loads(lines[-1])
    err = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
    oom = "memory" in err.lower() or "alloc" in err.lower() or r.returncode in (-9, 137)
    return {"ok": False, "why": "OOM (over budget)" if oom else err[:120]}


def fmt(res: dict, key: str, spec: str) -> str:
    return format(res[key], spec) if res.get("ok") else res.get("why", "-")


def bench_table(args) -> None:
    ref = "dense" if "dense" in args.backends else args.backends[0]
    print(f"\nfwd+bwd, {'full' if args.full else 'sparse'} layers, B={args.batch} H={args.heads} "
          f"Hkv={args.kv_heads} D={args.dim} block={args.block} window={args.window} top_k={args.top_k} "
          f"{args.device} {args.dtype}, budget {args.budget_gib:g} GiB; ratios = {ref} / backend\n")
    print(f"| S | backend | time (s) | peak mem (GiB) | speedup vs {ref} | memory saving vs {ref} |")
    print("|---|---|---|---|---|---|")
    for S in args.seq:
        res = {b: run_one(args, b, S) for b in args.backends}
        for b in args.backends:
            r, rr = res[b], res[ref]
            both = r.get("ok") and rr.get("ok")
            sp = f"{rr['time_s'] / r['time_s']:.1f}x" if both else "-"
            mem = f"{rr['peak_gib'] / max(r['peak_gib'], 1e-6):.1f}x" if both else "-"
            print(f"| {S} | {b} | {fmt(r, 'time_s', '.3f')} | {fmt(r, 'peak_gib', '.2f')} | {sp} | {mem} |",
                  flush=True)


def max_seq(args) -> None:
    print(f"\nlongest trainable S (fwd+bwd, one step) within {args.budget_gib:g} GiB, {args.device}, "
          f"{'full' if args.full else 'sparse'} layers; doubling from {args.max_seq_start}, then "
          f"{args.bisect_steps} bisection steps\n")
    rows = []
    for b in args.backends:
        ok_S, ok_res, bad_S, why = 0, None, None, "-"
        S = args.max_seq_start
        while args.max_seq_limit >= S:
            r = probe(args, b, S)
            if not r["ok"]:
                bad_S, why = S, r["why"]
                break
            ok_S, ok_res, S = S, r, S * 2
        for _ in range(args.bisect_steps if bad_S and ok_S else 0):
            mid = (ok_S + bad_S) // 2 // args.block * args.block
            r = probe(args, b, mid)
            if r["ok"]:
                ok_S, ok_res = mid, r
            else:
                bad_S, why = mid, r["why"]
        bad = f"{bad_S} ({why})" if bad_S else f"none up to {args.max_seq_limit}"
        rows.append(f"| {b} | {ok_S or '-'} | {bad} | {fmt(ok_res or {}, 'peak_gib', '.2f')} |")
    print("\n| backend | longest S that fit | first S that failed (why) | peak mem at longest (GiB) |")
    print("|---|---|---|---|")
    print("\n".join(rows), flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args._child:
        backend, S = args._child.split(":")
        print(json.dumps(child(args, backend, int(S))))
        return
    max_seq(args) if args.max_seq else bench_table(args)


if __name__ == "__main__":
    main()
