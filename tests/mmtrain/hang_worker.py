"""The hang fuzzer's worker (test_hang_fuzz.py), run under torchrun on gloo with a short timeout:

`python tests/mmtrain/hang_worker.py fuzz CONFIG SEED STEPS OUT` trains STEPS steps of the real
trainer (its mesh, model, objective) on per-rank batches built here, then evaluates shards of
different lengths; every data-parallel slot gets its own batch each micro-batch (ranks of a context
group or a pipeline share rows, as they must): whole, a random subset of the rows, rows cut to padding
from a document boundary in the first 1/(cp tp) of the row (the last context rank's chunk: padding
only), only the media-free rows, or the one-row pad batch (no medium, no routed token). At dist.pp > 1
the schedule's shapes are static (the loader's B rows), so rows are blanked to padding, not dropped:
a subset of rows, the media-free rows, or every row left (an all-padding batch).
`... mismatch OUT CASE` has rank 1 skip a collective that rank 0 calls: both must name theirs.
"""

from __future__ import annotations

import faulthandler
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

KINDS = ("whole", "rows", "tail", "text", "pad")


def fuzz_batch(batch, kind: str, rng: random.Random, cp: int, pad, fixed_rows: bool = False):
    """`fixed_rows` (dist.pp > 1): the batch keeps its B rows, the ones left out blanked to padding."""
    from mmtrain.objectives.terms import take_rows

    B, S = batch.tokens_BS.shape
    keep = (lambda rows_R: pad_from(batch, [S if b in rows_R else 0 for b in range(B)])) if fixed_rows \
        else (lambda rows_R: take_rows(batch, torch.tensor(rows_R, dtype=torch.long)))
    if kind == "rows":
        return keep(sorted(rng.sample(range(B), rng.randint(1, max(1, B - 1)))))
    if kind == "text":
        rows_R = (batch.media_ids_BS < 0).all(1).nonzero().squeeze(1).tolist()
        return keep(rows_R) if len(rows_R) or fixed_rows else pad()
    if kind == "pad":
        return keep([]) if fixed_rows else pad()
    if kind == "tail":
        return tail_padding(batch, rng, cp)
    return batch


def tail_padding(batch, rng: random.Random, cp: int):
    """Every token from a document boundary (or the row start) within the first S / cp on: padding."""
    S = batch.tokens_BS.shape[1]
    cuts_B = []
    for doc_S in batch.doc_ids_BS:
        starts = [0] + [s for s in range(1, S // cp) if doc_S[s] != doc_S[s - 1]]
        cuts_B.append(rng.choice(starts))
    return pad_from(batch, cuts_B)


def pad_from(batch, cuts_B: list[int]):
    """Row b padding from token cuts_B[b] on (S: untouched, 0: all padding); the media no longer
    named are dropped."""
    from mmtrain.data_pipelines.batch import IGNORE_INDEX, TASK_PAD
    from mmtrain.objectives.terms import take_rows

    B, S = batch.tokens_BS.shape
    fields = {f: getattr(batch, f).clone() for f in ("tokens_BS", "labels_BS", "doc_ids_BS", "span_ids_BS",
                                                      "modality_BS", "task_BS", "media_ids_BS")}
    pad_BS = dict(tokens_BS=0, labels_BS=IGNORE_INDEX, doc_ids_BS=-1, span_ids_BS=-1, modality_BS=0,
                  task_BS=TASK_PAD, media_ids_BS=-1)
    for b, cut in enumerate(cuts_B):
        for name, value in pad_BS.items():
            fields[name][b, cut:] = value
        if 0 < cut < S:
            fields["labels_BS"][b, cut - 1] = IGNORE_INDEX
    return take_rows(replace(batch, **fields), torch.arange(B))


def fuzz(config: str, seed: int, steps: int, out: str) -> None:
    from mmtrain.config import load_config
    from mmtrain.data_pipelines.loader import build_loader
    from mmtrain.evaluation.dist_eval import evaluate_ranks
    from mmtrain.loop.trainer import Trainer
    from mmtrain.parallel.distributed import exit_now, init_distributed, shutdown
    from mmtrain.run_config import RunConfig

    # a wait that no timeout bounds: every thread's stack, then exit (torchrun's workers have their
    # own sessions, so the test's kill of torchrun would leave them behind)
    faulthandler.dump_traceback_later(120, exit=True)
    cfg = load_config(RunConfig, config)
    env = init_distributed(cfg.dist, "cpu")
    trainer = Trainer(cfg, verbose=False, env=env)
    dims, cp = trainer.dims, trainer.dims.seq_size  # a row's chunks: the (cp, tp) group's
    it = iter(build_loader(cfg.data, trainer.tokenizer, "train", dims.dp_rank, dims.dp_size))
    log, accum, fixed = [], cfg.train.grad_accum, dims.pp > 1
    for step in range(steps):
        batches = []
        for n in range(step * accum, (step + 1) * accum):  # a data rank's micro-batches, numbered
            rng = random.Random(f"{seed}/{n}/{dims.dp_rank}")
            kind = KINDS[(n + seed + 2 * dims.dp_rank) % len(KINDS)]
            batches.append(fuzz_batch(next(it), kind, rng, cp, trainer.pad_batch, fixed))
            b = batches[-1]
            log.append((kind, int(b.tokens_BS.shape[0]), int(b.grid_thw_M3.shape[0]), b.num_tokens()))
        trainer.train_step(iter(batches))
    rng = random.Random(f"{seed}/eval/{dims.dp_rank}")  # shards of 1-3 batches: the shorter ones pad
    pool = [next(it) for _ in range(3)]  # every rank reads alike: the loader agrees per batch
    val = [fuzz_batch(b, rng.choice(KINDS), rng, cp, trainer.pad_batch)
           for b in pool[:1 + (dims.dp_rank + seed) % 3]]
    trainer.refresh_replica()  # dist.pp > 1: the evaluation runs on the pipeline's first rank's replica
    result = evaluate_ranks(trainer.model, val, trainer.device, env, pad=trainer.pad_batch,
                            autocast=trainer.autocast, evaluates=trainer.train_module.evaluates)
    if env.is_main:
        Path(out).write_text(json.dumps({"batches": log, "eval": result.to_dict()}))
    print(f"rank {env.rank}: {log}", file=sys.stderr)
    shutdown()
    exit_now(0)


def mismatch(out: str, case: str) -> None:
    """Rank 1 skips the collective that rank 0 waits in (an all-reduce, comm.py's all-to-all, or the
    send of a pipeline schedule's receive: pipeline_p2p.py), and waits in an all-gather instead."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from mmtrain.parallel import pipeline_p2p
    from mmtrain.parallel.comm import all_to_all_single
    from mmtrain.parallel.config import DistConfig
    from mmtrain.parallel.distributed import exit_now, init_distributed

    faulthandler.dump_traceback_later(30, exit=True)  # an unbounded wait: stacks, then exit
    env = init_distributed(DistConfig(timeout_s=3), "cpu")
    dist.all_reduce(torch.ones(2))  # both: agreed
    try:
        if env.rank == 0 and case == "all_reduce":
            dist.all_reduce(torch.ones(3))  # SKIPPED-BY-RANK-1 all_reduce
        if env.rank == 0 and case == "all_to_all":
            all_to_all_single(torch.empty(2), torch.ones(2), None, None, None)  # SKIPPED-BY-RANK-1 all_to_all
        if env.rank == 0 and case == "p2p":  # as torch's schedule posts and waits (run under `named`)
            with pipeline_p2p.named(None):
                recv = [dist.P2POp(dist.irecv, torch.empty(3), 1)]
                schedules._wait_batch_p2p(schedules._batch_p2p(recv, desc="recv"))  # SKIPPED-BY-RANK-1 p2p
        dist.all_gather([torch.empty(5) for _ in range(env.world_size)], torch.ones(5))  # RANK-1-WAITS
    except Exception as e:
        Path(f"{out}.{env.rank}").write_text("\n".join(getattr(e, "__notes__", [])))
    time.sleep(4)  # not gone before the peer's own timeout ("Connection closed" instead)
    exit_now(0)


if __name__ == "__main__":
    if sys.argv[1] == "fuzz":
        from mmtrain.parallel import calls

        try:
            fuzz(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        except Exception:
            print(calls.report(), file=sys.stderr)  # where the ranks parted
            raise
    elif sys.argv[1] == "mismatch":
        mismatch(sys.argv[2], sys.argv[3])
