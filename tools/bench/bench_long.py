"""Long context on CPU: forward + backward of a run config's decoder on one row of S tokens.

    python -m tools.bench.bench_long --config configs/tiny.yaml --seq 131072 1048576 --doc-len 8192
    python -m tools.bench.bench_long --config configs/tiny.yaml --layout S --seq 1048576   # one document
    python -m tools.bench.bench_long --config configs/tiny.yaml --max-seq --budget-gib 16

What a user training at long context would run: activation checkpointing per decoder layer (as
`dist.activation_checkpointing: true`), the cross-entropy over the vocabulary in chunks of
`--ce-chunk` tokens (each chunk's logits recomputed in backward), the config's attention
(`gather` on CPU). The row is text split into documents of `--doc-len` tokens (0: one document),
optionally with a visual span of 16 tokens every `--image-every` tokens; the vision encoder is
not run (the decoder is what long context stresses). Each S runs in its own process (peak RSS
above the baseline, address space capped at the budget: see tools/bench/childproc.py); besides
the step time and peak memory it reports the attention metadata's bytes at that S.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tools.bench.childproc import GiB, cap_address_space, peak_since, run_child


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml", help="run config whose model.decoder is used")
    p.add_argument("--seq", type=int, nargs="+", default=[131072, 1048576])
    p.add_argument("--doc-len", type=int, default=0, help="documents of this many tokens (0: one)")
    p.add_argument("--image-every", type=int, default=0, help="a 16-token visual span every N tokens")
    p.add_argument("--layout", default=None, help="override model.decoder.layer_layout (e.g. S)")
    p.add_argument("--select", default=None, choices=["token", "block"], help="override attention.select")
    p.add_argument("--block", type=int, default=None, help="override attention.block_size (window: 4 blocks)")
    p.add_argument("--ac", default="layer", choices=["layer", "sublayer"],
                   help="checkpoint each decoder layer, or its attention and FFN halves separately")
    p.add_argument("--ffn-chunk", type=int, default=None,
                   help="override model.decoder.ffn_chunk (FFN/MoE on checkpointed chunks of N tokens)")
    p.add_argument("--mmap-threshold", type=int, default=131072,
                   help="glibc M_MMAP_THRESHOLD in bytes for the child (0: glibc's dynamic default)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--ce-chunk", type=int, default=65536)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget-gib", type=float, default=16.0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per S")
    p.add_argument("--max-seq", action="store_true", help="double S from --seq[0] until it fails")
    p.add_argument("--_child", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def row_inputs(S: int, doc_len: int, image_every: int, vocab: int) -> dict:
    import torch

    pos_S = torch.arange(S)
    doc_S = pos_S // doc_len if doc_len else torch.zeros(S, dtype=torch.long)
    rel_S = pos_S % doc_len if doc_len else pos_S
    span_S = torch.full((S,), -1)
    modality_S = torch.zeros(S, dtype=torch.long)
    if image_every:
        for i, start in enumerate(range(image_every // 2, S - 16, image_every)):
            span_S[start:start + 16], modality_S[start:start + 16] = i, 1
    return dict(tokens_BS=torch.randint(3, vocab, (1, S)), pos_ids_3BS=rel_S.expand(3, 1, S).contiguous(),
                doc_ids_BS=doc_S[None].int(), span_ids_BS=span_S[None].int(), modality_BS=modality_S[None])


def fix_mmap_threshold(nbytes: int) -> bool:
    """glibc: allocations of >= nbytes get their own mmap, returned to the OS when freed. By default
    the threshold rises with every freed large block (up to 32 MiB); past that, freed mid-size
    tensors (the attention's per-tile buffers) stay in the heap and the RSS peak counts fragments,
    not live tensors (at 65k tokens: 1.43 vs 0.80 GiB). A fixed threshold keeps RSS honest."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, nbytes))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False  # not glibc: the allocator's own policy stands


def child(args) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from mmtrain.config import load_config
    from mmtrain.models.attention import build_meta
    from mmtrain.models.decoder import Decoder
    from mmtrain.parallel.parallelize import checkpoint_forward, prime_probes
    from mmtrain.run_config import RunConfig

    torch.set_num_threads(args.threads)
    mmap_fixed = bool(args.mmap_threshold) and fix_mmap_threshold(args.mmap_threshold)
    S = args._child
    overrides = [f"model.decoder.vocab_size={args.vocab}"]
    overrides += [f"model.decoder.layer_layout={args.layout}"] if args.layout else []
    overrides += [f"model.decoder.attention.select={args.select}"] if args.select else []
    overrides += [f"model.decoder.ffn_chunk={args.ffn_chunk}"] if args.ffn_chunk is not None else []
    if args.block:
        overrides += [f"model.decoder.attention.block_size={args.block}",
                      f"model.decoder.attention.window={4 * args.block}"]
    cfg = load_config(RunConfig, args.config, overrides).model.decoder
    torch.manual_seed(0)
    dec = Decoder(cfg).train()
    prime_probes(torch.device("cpu"))
    for layer in dec.layers:  # activation checkpointing, as the trainer applies it (or finer)
        for part in ((layer,) if args.ac == "layer" else (layer.attn, layer.ffn)):
            checkpoint_forward(part)
    x = row_inputs(S, args.doc_len, args.image_every, args.vocab)
    labels_S = x["tokens_BS"][0].roll(-1)

    def ce(h_CD, y_C):
        return F.cross_entropy(dec.logits(h_CD).float(), y_C, reduction="sum")

    base = cap_address_space(args.budget_gib)
    t0 = time.perf_counter()
    meta = build_meta(x["doc_ids_BS"], x["span_ids_BS"], cfg.attention.block_size)
    meta.aligned()
    meta_b = sum(t.numel() * t.element_size() for t in [*vars(meta).values(), *vars(meta.aligned()).values()]
                 if isinstance(t, torch.Tensor))
    h_SD = dec(**x).hidden_BSD[0]
    loss = sum(checkpoint(ce, h_SD[c:c + args.ce_chunk], labels_S[c:c + args.ce_chunk], use_reentrant=False)
               for c in range(0, S, args.ce_chunk)) / S
    t_fwd, fwd_peak = time.perf_counter() - t0, peak_since(base)
    loss.backward()
    return {"ok": True, "S": S, "fwd_s": t_fwd, "step_s": time.perf_counter() - t0,
            "peak_gib": peak_since(base), "fwd_peak_gib": fwd_peak, "meta_gib": meta_b / GiB,
            "loss": float(loss), "mmap_threshold": args.mmap_threshold if mmap_fixed else None}


def run_s(args, S: int) -> dict:
    argv = [a for a in sys.argv[1:] if a != "--max-seq"] + ["--_child", str(S)]
    r = run_child("tools.bench.bench_long", argv, args.timeout)
    state = (f"fwd {r['fwd_s']:.1f} s (peak {r['fwd_peak_gib']:.2f} GiB), fwd+bwd {r['step_s']:.1f} s, "
             f"peak {r['peak_gib']:.2f} GiB, "
             f"metadata {r['meta_gib'] * 1024:.1f} MiB" if r["ok"] else r["why"])
    print(f"| {S:,} | {state} |", flush=True)
    return r


def main(argv=None) -> None:
    args = parse_args(argv)
    if args._child:
        print(json.dumps(child(args)))
        return
    print(f"# {args.config} decoder (layout {args.layout or 'as configured'}, "
          f"select {args.select or 'as configured'}), one row, documents of {args.doc_len or 'S'} tokens, "
          f"visual span every {args.image_every or '-'}; {args.threads} threads, "
          f"budget {args.budget_gib:g} GiB, fwd+bwd with activation checkpointing\n")
    print("| S | result |\n|---|---|")
    if not args.max_seq:
        for S in args.seq:
            run_s(args, S)
        return
    S = args.seq[0]
    while run_s(args, S)["ok"]:
        S *= 2


if __name__ == "__main__":
    main()
