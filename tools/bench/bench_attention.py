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
(which also compiles flex on CUDA). `--breakdown` adds what the sparse path holds besides the
attention itself: the metadata (`build_meta` + the aligned layout), the selection (picks) and
the per-tile block lists, as tensor bytes, and the time of the selection alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from tools.bench.childproc import GiB, cap_address_space, peak_since, run_child


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
    p.add_argument("--select", default="block", choices=["token", "block"], help="who scores top-k blocks")
    p.add_argument("--full", action="store_true", help="full (non-sparse) layers instead of sparse")
    p.add_argument("--image-every", type=int, default=0,
                   help="insert a 256-token image span every N tokens (0: text only, one document)")
    p.add_argument("--breakdown", action="store_true",
                   help="metadata / selection / lists bytes, selection time")
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


def child(args, backend: str, S: int) -> dict:
    """One (backend, S): build inputs, warm up, time fwd+bwd, report peak memory."""
    import torch

    from mmtrain.models.attention import AttentionConfig, attend, build_meta

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
    cfg = AttentionConfig(backend=backend, block_size=args.block, window=args.window, top_k=args.top_k,
                          select=args.select)

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
        base = cap_address_space(args.budget_gib)
    times = []
    for _ in range(args.repeats + 1):  # the first is the warm-up (its time is kept only if repeats == 0)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times = times[1:] or times
    peak = (torch.cuda.max_memory_allocated() - base) / GiB if dev.type == "cuda" else peak_since(base)
    out = {"ok": True, "time_s": statistics.median(times), "peak_gib": peak}
    if args.breakdown and not args.full:
        out.update(breakdown(q, k, meta, cfg, dev))
    return out


def _nbytes(obj) -> int:
    """Bytes of the tensors held by a dataclass (or dict) of tensors."""
    import dataclasses

    import torch

    items = dataclasses.asdict(obj).values() if dataclasses.is_dataclass(obj) else obj.values()
    return sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))


def breakdown(q, k, meta, cfg, dev) -> dict:
    """Sizes of the sparse path's metadata, selection and block lists, and the selection's time."""
    import torch

    from mmtrain.models.attention import select_blocks
    from mmtrain.models.attention.blocks import sparse_lists

    with torch.no_grad():
        t0 = time.perf_counter()
        sel = select_blocks(q, k, meta, cfg)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        select_s = time.perf_counter() - t0
        lists = sparse_lists(meta, cfg, sel.picks_BGLk, sel.block_picks_BGAk)
        old_s, old_b = previous_rule_cost(q, k, cfg)
        mask_s = flex_mask_time(meta, cfg, sel, q.shape[1]) if dev.type == "cuda" else None
    meta_b = _nbytes({f: getattr(meta, f) for f in meta.__dataclass_fields__ if f != "cache"})
    return {"meta_gib": (meta_b + _nbytes(meta.aligned())) / GiB, "select_gib": _nbytes(sel.__dict__) / GiB,
            "lists_gib": lists.numel() * lists.element_size() / GiB, "lists_T": lists.shape[-1],
            "select_s": select_s, "old_select_s": old_s, "old_gib": old_b / GiB, "mask_s": mask_s}


def flex_mask_time(meta, cfg, sel, H: int) -> float:
    """Seconds to build a sparse layer's flex BlockMask from its selection (CUDA, synchronised)."""
    import torch

    from mmtrain.models.attention.flex import sparse_block_mask

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    sparse_block_mask(meta, cfg, sel, H)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def previous_rule_cost(q, k, cfg) -> tuple[float, int]:
    """Time and table bytes of the selection rule this project used before the causal one (its
    cost only: block-mean queries of whole row blocks against block-mean keys, a Q x Q score
    table per selection head, top-k; plus the seven Q x Q bool tables its metadata held)."""
    import torch
    import torch.nn.functional as F

    t0 = time.perf_counter()
    B, H, S, D = q.shape
    K, Bs = k.shape[1], cfg.block_size
    Q = -(-S // Bs)
    pad = (0, 0, 0, Q * Bs - S)
    qm_BKQD = F.pad(q.float(), pad).view(B, K, H // K, Q, Bs, D).mean((2, 4))
    km_BKQD = F.pad(k.float(), pad).view(B, K, Q, Bs, D).mean(3)
    score_BKQQ = qm_BKQD @ km_BKQD.transpose(-1, -2)
    q_Q = torch.arange(Q, device=q.device)
    score_BKQQ = score_BKQQ.masked_fill(q_Q[None, :] >= q_Q[:, None], float("-inf"))
    score_BKQQ.topk(min(cfg.top_k, Q), dim=-1)
    if q.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, score_BKQQ.numel() * 4 + 7 * B * Q * Q


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
    return run_child("tools.bench.bench_attention", [*argv, "--_child", f"{backend}:{S}"], args.timeout)


def fmt(res: dict, key: str, spec: str) -> str:
    return format(res[key], spec) if res.get("ok") else res.get("why", "-")


def bench_table(args) -> None:
    ref = "dense" if "dense" in args.backends else args.backends[0]
    print(f"\nfwd+bwd, {'full' if args.full else 'sparse'} layers, B={args.batch} H={args.heads} "
          f"Hkv={args.kv_heads} D={args.dim} block={args.block} window={args.window} top_k={args.top_k} "
          f"select={args.select} {args.device} {args.dtype}, budget {args.budget_gib:g} GiB; "
          f"ratios = {ref} / backend\n")
    extra = (" metadata (GiB) | selection (GiB) | lists (GiB, T) | select (s) | previous rule (s / GiB) |"
             " flex mask build (s) |" if args.breakdown else "")
    print(f"| S | backend | time (s) | peak mem (GiB) | speedup vs {ref} | memory saving vs {ref} |{extra}")
    print("|---|---|---|---|---|---|" + "---|" * (6 if args.breakdown else 0))
    for S in args.seq:
        res = {b: run_one(args, b, S) for b in args.backends}
        for b in args.backends:
            r, rr = res[b], res[ref]
            both = r.get("ok") and rr.get("ok")
            sp = f"{rr['time_s'] / r['time_s']:.1f}x" if both else "-"
            mem = f"{rr['peak_gib'] / max(r['peak_gib'], 1e-6):.1f}x" if both else "-"
            more = ""
            if args.breakdown and r.get("ok") and "meta_gib" in r:
                more = (f" {r['meta_gib']:.4f} | {r['select_gib']:.4f} | {r['lists_gib']:.4f}, {r['lists_T']}"
                        f" | {r['select_s']:.3f} | {r['old_select_s']:.3f} / {r['old_gib']:.4f} |"
                        f" {'-' if r['mask_s'] is None else format(r['mask_s'], '.4f')} |")
            row = f"| {S} | {b} | {fmt(r, 'time_s', '.3f')} | {fmt(r, 'peak_gib', '.2f')} | {sp} | {mem} |"
            print(row + more, flush=True)


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
