"""How many times compiled flex compiles over batches of varied documents: the aligned length A
exact (what it was) or bucketed (meta.py), counted with Dynamo's CompileCounter (one frame = one
Inductor compile; no code is generated, so it runs on CPU in seconds).

    python -m tools.bench.bench_compile_counts --seq-len 256 --batches 50

One row of S tokens per batch (models.attention.testing.random_batch: documents of random
lengths, visual spans, padding), a sparse layer every batch and a full layer once. Dynamo's
recompile limit (8) stays at its default, as in a run: past it a shape runs eagerly.
"""

from __future__ import annotations

import argparse
import random

import torch
from torch._dynamo.testing import CompileCounter
from torch.nn.attention.flex_attention import flex_attention

from mmtrain.models.attention import AttentionConfig, attend, build_meta, flex
from mmtrain.models.attention import meta as meta_module
from mmtrain.models.attention.testing import random_batch, random_qkv


def count(S: int, Bs: int, batches: int, exact: bool, seed: int) -> tuple[int, list[int]]:
    torch._dynamo.reset()
    torch.manual_seed(seed)
    random.seed(seed)
    bucket = meta_module.bucket_blocks
    if exact:
        meta_module.bucket_blocks = lambda need, S, Bs: max(need, 1)
    counter = CompileCounter()
    compiled = torch.compile(flex_attention, dynamic=False, backend=counter)
    flex.compiled_flex = lambda: compiled
    cfg = AttentionConfig(backend="flex", block_size=Bs, window=Bs, top_k=1)
    sizes = set()
    try:
        for i in range(batches):
            meta = build_meta(*random_batch(1, S, Bs), Bs)
            q, k, v = random_qkv(1, 2, 1, S, 8, grad=False)
            with torch.no_grad():
                attend(q, k, v, meta, cfg, sparse=True)
                if i == 0:
                    attend(q, k, v, meta, cfg, sparse=False)
            sizes.add(meta.aligned_blocks)
    finally:
        meta_module.bucket_blocks = bucket
    return counter.frame_count, sorted(sizes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for exact in (True, False):
        n, sizes = count(args.seq_len, args.block, args.batches, exact, args.seed)
        print(f"A {'exact' if exact else 'bucketed'}: {n} compiles, A values {sizes}")


if __name__ == "__main__":
    main()
