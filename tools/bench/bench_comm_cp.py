"""CP's selective K/V fetch vs an all-gather of K/V, for tools/bench/bench_comm.py (`--part cp`).

`cp_fetch` counts, on one row and the model's own selection (models/attention/select.py,
blocks.sparse_lists), the K/V bytes each of cp contiguous chunks fetches from the others, as
models/attention/context.py does; `cp_check` runs that layer on cp gloo ranks on the same row and
returns the bytes each rank's collectives counted (`python -m tools.bench.bench_comm_cp` is its
worker), which must be the same.

Legend: S row tokens, A aligned blocks, G selection heads (= kv heads here), Bs block size,
C chunks, X = A + 1 (the null block).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cp_row(S: int, doc_len: int, image_every: int, image_tokens: int, heads: int, head_dim: int, seed: int,
           queries: str = "random"):
    """One row: documents of doc_len tokens (0: one), a visual span of image_tokens every
    image_every tokens (0: text only), iid normal keys and queries for `heads` selection heads
    (the group-mean query of each kv group is what select_blocks scores with). `queries`:
    "random", iid per token, so a query block's picks are uniform over its candidates (the widest
    union a chunk can need); "shared", one query vector for every token, so every query block
    ranks the blocks alike (picks shared across the chunk: the narrowest). With iid keys neither
    depends on the head dim, so head_dim may be scaled down."""
    import torch

    pos = torch.arange(S)
    doc = pos // doc_len if doc_len else torch.zeros(S, dtype=torch.long)
    span = torch.full((S,), -1)
    if image_every:
        for i, start in enumerate(range(image_every // 2, S - image_tokens, image_every)):
            span[start:start + image_tokens] = i
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, heads, S, head_dim, generator=gen)
    q = (torch.randn(1, heads, S, head_dim, generator=gen) if queries == "random"
         else torch.randn(1, heads, 1, head_dim, generator=gen).expand(1, heads, S, head_dim))
    return doc[None], span[None], q, k


def cp_fetch(S: int, cps: list[int], attn_cfg, kv_heads: int, real_head_dim: int, head_dim: int,
             doc_len: int = 0, image_every: int = 0, image_tokens: int = 1024, seed: int = 0,
             queries: str = "random", kv_bytes: int = 2) -> dict:
    """Per cp: the K/V bytes each chunk fetches (the tokens, in other chunks, of the blocks its
    tiles keep for any selection head, with every kv head: as models/attention/context.py does;
    `per_head_max`: were each kv head to fetch only its own blocks) and an all-gather's; K and V
    of `real_head_dim` at `kv_bytes` (bf16)."""
    import torch

    from mmtrain.models.attention.blocks import sparse_lists
    from mmtrain.models.attention.meta import build_meta
    from mmtrain.models.attention.select import select_blocks

    doc_BS, span_BS, q, k = cp_row(S, doc_len, image_every, image_tokens, kv_heads, head_dim, seed, queries)
    meta = build_meta(doc_BS, span_BS, attn_cfg.block_size)
    sel = select_blocks(q, k, meta, attn_cfg)
    del q, k
    lists_GAT = sparse_lists(meta, attn_cfg, sel.picks_BGLk, sel.block_picks_BGAk)[0]
    lay = meta.aligned()
    A, Bs = lay.aligned_blocks, attn_cfg.block_size
    G = lists_GAT.shape[0]
    src_AB = lay.src_BL[0].view(A, Bs)
    per_token_head = 2 * real_head_dim * kv_bytes  # K and V
    out = {"S": S, "A": A, "cp": {}}
    for cp in cps:
        chunk = S // cp
        owner_AB = torch.where(src_AB >= 0, src_AB // chunk, -1)
        held_CA = torch.stack([(owner_AB == c).sum(1) for c in range(cp)])  # block tokens per chunk
        fetch, per_head, sent = [], [], [0] * cp
        for c in range(cp):
            tiles_A = (owner_AB == c).any(1)  # tiles with a query token of chunk c
            need_GX = torch.zeros(G, A + 1, dtype=torch.bool)
            need_GX.scatter_(1, lists_GAT[:, tiles_A].reshape(G, -1), True)
            remote_A = ((owner_AB >= 0) & (owner_AB != c)).sum(1)  # the block's tokens elsewhere
            # as models/attention/context.py fetches: the blocks any head keeps, with all K heads
            from_C = (held_CA * need_GX[:, :A].any(0)).sum(1) * G
            fetch.append(int(from_C.sum() - from_C[c]))
            for d in range(cp):
                sent[d] += int(from_C[d]) if d != c else 0
            per_head.append(int((need_GX[:, :A].long() * remote_A).sum()))  # each head its own blocks
        gather = (cp - 1) * chunk * G
        out["cp"][cp] = {"fetch_max": max(fetch) * per_token_head, "gather": gather * per_token_head,
                         "fetch_mean": sum(fetch) / cp * per_token_head,
                         "per_head_max": max(per_head) * per_token_head,
                         "fetch_P": [f * per_token_head for f in fetch],  # received by each rank
                         "sent_P": [f * per_token_head for f in sent],  # sent by each (= Traffic's)
                         "key_sums_all_reduce": A * G * real_head_dim * 4 * 2 * (cp - 1) / cp}
    return out


def cp_worker(args: dict, out: str) -> None:
    """Under torchrun: every rank runs models/attention/context.py's sparse layer on its chunk of
    the `cp_row` that `cp_fetch` counts, with the trainer's collectives (CPComm), forward only;
    rank 0 writes each rank's counted `cp_kv_fetch` bytes."""
    import torch
    import torch.distributed as dist

    from mmtrain.models.attention.config import AttentionConfig
    from mmtrain.models.attention.context import ContextShard, attend_context
    from mmtrain.models.attention.meta import build_meta
    from mmtrain.parallel.comm import Traffic
    from mmtrain.parallel.context_parallel import CPComm

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = AttentionConfig(**args["attn"])
    doc_BS, span_BS, q, k = cp_row(args["S"], args["doc_len"], args["image_every"], args["image_tokens"],
                                   args["kv_heads"], args["head_dim"], args["seed"], args["queries"])
    traffic = Traffic()
    shard = ContextShard(CPComm(dist.group.WORLD, traffic), args["S"])
    meta = build_meta(doc_BS, span_BS, cfg.block_size)
    with torch.no_grad():
        k_BKsD = shard.local(k, 2)
        attend_context(shard.local(q, 2), k_BKsD, k_BKsD.clone(), meta, cfg, True, shard)  # V: any values
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, traffic.sent.get("cp_kv_fetch", 0))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(got))
    dist.barrier()
    dist.destroy_process_group()


def cp_check(args: dict, cp: int, timeout: float = 180) -> tuple[list[int], list[float]]:
    """(bytes each rank's context-parallel layer counted, bytes `cp_fetch` computes) on one row."""
    from mmtrain.models.attention.config import AttentionConfig

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cp.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}",
               "--monitor-interval=0.2", "-m", "tools.bench.bench_comm_cp", json.dumps(args), str(out)]
        proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"the {cp}-rank CP worker failed:\n{proc.stderr[-3000:]}")
        counted = json.loads(out.read_text())
    r = cp_fetch(args["S"], [cp], AttentionConfig(**args["attn"]), args["kv_heads"], args["head_dim"],
                 args["head_dim"], args["doc_len"], args["image_every"], args["image_tokens"], args["seed"],
                 args["queries"], kv_bytes=4)
    return counted, r["cp"][cp]["sent_P"]


def part_cp(cfg, seqs: list[int], cps: list[int], rows: list[tuple[str, int, int]], head_dim: int) -> None:
    """The table of docs/BENCHMARKS.md for run config `cfg` (`long`)."""
    attn, dec = cfg.model.decoder.attention, cfg.model.decoder
    real_hd = dec.dim // dec.n_heads
    print(f"\n### CP, one sparse layer of `long` (block {attn.block_size}, window {attn.window}, "
          f"top_k {attn.top_k}, sink, visual_always {attn.visual_always}, select {attn.select}); "
          f"{dec.n_kv_heads} kv heads x {real_hd}, bf16 K/V; random q/k of head dim {head_dim}\n")
    print("| S | row | queries | cp | all-gather MiB/rank | selective fetch MiB/rank: mean, max "
          "| fetch vs all-gather (max rank) | per-head fetch, max | key-sum all-reduce MiB/rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    for S in seqs:
        for row, doc_len, image_every in rows:
            for queries in ("random", "shared"):
                r = cp_fetch(S, [c for c in cps if S % c == 0], attn, dec.n_kv_heads, real_hd, head_dim,
                             doc_len, image_every, queries=queries)
                for cp, v in r["cp"].items():
                    mib = {k: x / 2**20 for k, x in v.items() if not k.endswith("_P")}
                    print(f"| {S} | {row} | {queries} | {cp} | {mib['gather']:.0f} | "
                          f"{mib['fetch_mean']:.0f}, {mib['fetch_max']:.0f} | "
                          f"{v['fetch_max'] / v['gather']:.2f} | {mib['per_head_max']:.0f} | "
                          f"{mib['key_sums_all_reduce']:.1f} |",
                          flush=True)


if __name__ == "__main__":
    cp_worker(json.loads(sys.argv[1]), sys.argv[2])
