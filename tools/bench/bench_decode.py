"""KV-cache decoding: per-token latency and tokens/s at long contexts, sparse layers against full
layers in the same run, and prefill against the training forward.

    python -m tools.bench.bench_decode --config configs/tiny.yaml --contexts 1024 16384 131072
    python -m tools.bench.bench_decode --contexts 256 1024 --prefill 256 1024 --steps 8   # a quick check

The config's model section with random weights (vocab --vocab), built twice from the same weights:
every decoder layer sparse (layout S) and every layer full (layout F). Decode: one row whose cache
holds `context` text tokens (filled directly with random keys/values and the block means they
imply: a prefill of 128k tokens through full layers is O(S^2)), then `--steps` decode steps after
`--warmup`; reported per token (median over steps) for the whole model and for one layer's
attention alone (full_decode vs sparse_decode on layer 0's cache). Growth = latency at the largest
context / at the smallest, against the context ratio (linear growth). Prefill: one document of S
text tokens, `prefill` (which also fills the cache) against the training forward
(`model(..., compute_logits=False)`, no grad) on the same inputs, median of --repeats.

Legend: B rows (1), S tokens, C cache capacity, K kv heads, E head dim, H heads.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from mmtrain.config import load_config
from mmtrain.models.inference import decode_step, new_cache, prefill
from mmtrain.models.inference.attend import full_decode, sparse_decode
from mmtrain.models.inference.cache import refresh_kmean
from mmtrain.models.multimodal import MultimodalModel
from mmtrain.run_config import RunConfig


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml", help="run config whose model section is used")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384, 131072])
    p.add_argument("--prefill", type=int, nargs="*", default=[1024, 16384], help="prefill lengths")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per context")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="prefill / forward timings (median)")
    p.add_argument("--select", default=None, choices=["token", "block"], help="override attention.select")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda (the GPU path is not exercised on CPU CI)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def models(config: str, vocab: int, seed: int, device: str = "cpu", dtype: str = "float32",
           select: str | None = None) -> dict[str, MultimodalModel]:
    """The config's model with every decoder layer sparse ("S") and every one full ("F"), same weights."""
    cfg = load_config(RunConfig, config, [f"model.decoder.attention.select={select}"] if select else []).model
    cfg.decoder.vocab_size = vocab
    out = {}
    for layout in ("S", "F"):
        c = copy.deepcopy(cfg)
        c.decoder.layer_layout = layout
        torch.manual_seed(seed)
        out[layout] = MultimodalModel(c).to(device, getattr(torch, dtype)).eval()
    return out


def filled_cache(model: MultimodalModel, context: int, extra: int):
    """A one-row cache holding `context` text tokens (random keys and values, unit-RMS like QK-norm's)."""
    dec = model.decoder.cfg
    Bs = dec.attention.block_size
    cache = new_cache(model, 1, -(-(context + extra) // Bs) * Bs, model.decoder.embed.weight.dtype)
    for lc in cache.layers:
        lc.k_BKCE[:, :, :context].normal_()
        lc.v_BKCE[:, :, :context].normal_()
        if lc.sparse:
            B, K, C, E = lc.k_BKCE.shape
            lc.kmean_BKNE.copy_(lc.k_BKCE.view(B, K, C // Bs, Bs, E).sum(-2) / Bs)
            if lc.qprev_BGE is not None:
                lc.qprev_BGE.normal_()
                lc.qcur_BGbE[:, :, :context % Bs].normal_()
    cache.len_B.fill_(context)
    cache.pos_B.fill_(context)
    return cache


def _times(fn, n: int, warmup: int) -> list[float]:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


@torch.no_grad()
def decode_latency(model: MultimodalModel, context: int, steps: int, warmup: int, vocab: int) -> dict:
    """Whole decode steps, then layer 0's attention alone (its selection state advancing as in
    decoding); means over the steps (a per-block selection is amortised over its block)."""
    cache = filled_cache(model, context, steps + warmup + 1)
    dev = model.decoder.embed.weight.device
    tokens = iter(torch.randint(3, vocab, (steps + warmup,), device=dev))
    step_s = _times(lambda: decode_step(model, cache, next(tokens).view(1)), steps, warmup)
    cache = filled_cache(model, context, steps + warmup + 1)
    lc, acfg = cache.layers[0], model.decoder.cfg.attention
    q_BH1E = torch.randn(1, model.decoder.cfg.n_heads, 1, model.decoder.cfg.head_dim, device=dev,
                         dtype=lc.k_BKCE.dtype)

    def attention():
        p_B = cache.len_B
        if lc.sparse:
            refresh_kmean(lc, p_B // acfg.block_size, acfg.block_size)
            sparse_decode(q_BH1E, lc, p_B, acfg)
        else:
            full_decode(q_BH1E, lc, p_B)
        cache.len_B = p_B + 1

    attn_s = _times(attention, steps, warmup)
    mean = statistics.fmean(step_s)
    return {"step_ms": mean * 1e3, "step_p50_ms": statistics.median(step_s) * 1e3, "tokens_per_s": 1 / mean,
            "attn_ms": statistics.fmean(attn_s) * 1e3, "cache_bytes_per_token": cache.bytes_per_token()}


@torch.no_grad()
def prefill_speed(model: MultimodalModel, S: int, repeats: int, vocab: int) -> dict:
    inputs = dict(tokens_BS=torch.randint(3, vocab, (1, S)), pos_ids_3BS=torch.arange(S).expand(3, 1, S),
                  doc_ids_BS=torch.zeros(1, S, dtype=torch.int32), span_ids_BS=torch.full((1, S), -1),
                  modality_BS=torch.zeros(1, S, dtype=torch.int8),
                  patches_NP=torch.zeros(0, model.cfg.vision.patch_dim),
                  grid_thw_M3=torch.zeros(0, 3, dtype=torch.long))
    w = model.decoder.embed.weight
    inputs = {k: v.to(w.device, w.dtype if v.is_floating_point() else None) for k, v in inputs.items()}
    pre = statistics.median(_times(lambda: prefill(model, **inputs, capacity=S + 1), repeats, 1))
    fwd = statistics.median(_times(lambda: model(**inputs, compute_logits=False), repeats, 1))
    return {"prefill_tok_s": S / pre, "forward_tok_s": S / fwd, "ratio": fwd / pre}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ms = models(args.config, args.vocab, args.seed, args.device, args.dtype, args.select)
    dec = ms["S"].cfg.decoder
    acfg = dec.attention
    print(f"{args.config}: {dec.n_layers} layers, dim {dec.dim}; sparse: block {acfg.block_size}, window "
          f"{acfg.window}, top_k {acfg.top_k}, select {acfg.select}; {args.device} {args.dtype}, "
          f"{args.threads} threads")
    res: dict = {"decode": {}, "prefill": {}}
    print(f"{'context':>8} | {'S ms/tok':>8} {'F ms/tok':>8} {'F/S':>6} | {'S attn ms':>9} {'F attn ms':>9} "
          f"{'F/S':>6} | {'S B/tok':>8} {'F B/tok':>8}")
    for L in args.contexts:
        r = {k: decode_latency(m, L, args.steps, args.warmup, args.vocab) for k, m in ms.items()}
        res["decode"][L] = r
        s, f = r["S"], r["F"]
        print(f"{L:>8} | {s['step_ms']:8.2f} {f['step_ms']:8.2f} {f['step_ms'] / s['step_ms']:6.1f} | "
              f"{s['attn_ms']:9.3f} {f['attn_ms']:9.3f} {f['attn_ms'] / s['attn_ms']:6.1f} | "
              f"{s['cache_bytes_per_token']:8.0f} {f['cache_bytes_per_token']:8.0f}", flush=True)
    lo, hi = min(args.contexts), max(args.contexts)
    if hi > lo:
        for k in ("S", "F"):
            d = res["decode"]
            print(f"growth {k}: step x{d[hi][k]['step_ms'] / d[lo][k]['step_ms']:.1f}, attention "
                  f"x{d[hi][k]['attn_ms'] / d[lo][k]['attn_ms']:.1f} for x{hi / lo:.0f} context")
    for S in args.prefill or []:
        r = {k: prefill_speed(m, S, args.repeats, args.vocab) for k, m in ms.items()}
        res["prefill"][S] = r
        parts = [f"{k} {v['prefill_tok_s']:,.0f} tok/s vs forward {v['forward_tok_s']:,.0f} "
                 f"(x{v['ratio']:.2f})" for k, v in r.items()]
        print(f"prefill {S:>7}: " + "; ".join(parts), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
