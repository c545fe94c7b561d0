"""Bytes per GPU per step moved by tensor parallelism (activation all-gathers / reduce-scatters) and
by pipeline parallelism (activation send / recv between stages), beside bench_comm.py's EP / FSDP.

    python -m tools.bench.bench_comm_tp_pp                  # measure (tiny, gloo) + compute (base, m3)
    python -m tools.bench.bench_comm_tp_pp --part compute   # the formulas at real shapes only

compute also gives EP's all-to-all and CP's K/V all-gather ceiling at the same shapes, so that
docs/DISTRIBUTED.md ("When to choose TP, PP, EP or CP") compares the four on one footing.

measure: `configs/tiny.yaml` on the built-in corpus, one real trainer step (mmtrain/loop/trainer.py)
  at TP(2) on 2 gloo ranks, with and without activation checkpointing; the bytes the trainer's own
  `Traffic` counts (mmtrain/parallel/tensor_parallel.py: what NCCL's ring would send) against
  `tp_bytes` at the same rows. PP: the pipeline worker of the tests (tests/mmtrain/pipeline_worker.py,
  PP(2), 1F1B, 2 micro-batches) with torch.distributed's point-to-point sends counted, against
  `pp_bytes`.
compute: the same formulas at the configs' shapes (bf16 activations, the configs' rows per rank).

TP, per decoder layer and micro-batch (P = tp, V = B x S / cp x D x b the tp group's activation of
its rows): attention all-gathers its input and reduce-scatters its output, the SwiGLU (dense, or
a MoE layer's shared expert; none without one) the same: 4 collectives of (P - 1) / P x V forward,
4 backward (each one's transpose), 4 again in the recompute under activation checkpointing (3 in
a dense-FFN layer: the recompute stops before the FFN's reduce-scatter, see `tp_bytes`); plus
the rotary tables' all-gather (cos and sin, fp32, B x S / cp x head_dim / 2 each, forward and
recompute only: no gradient).
PP, per micro-batch and stage boundary: the residual stream B x S x D x b forward and its gradient
backward, plus the (2,) fp32 auxiliary-loss carry each way (mmtrain/parallel/pipeline.py). A
middle stage sends both, an end stage one of them: the per-GPU figure below is a middle stage's.

Legend: B rows per rank per micro-batch, S row tokens, D decoder width, b activation bytes,
m micro-batches per step, L decoder layers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY_TP = ["dist.tp=2", "model.decoder.n_kv_heads=2", "data.batch_size=2", "train.log_every=1"]
AUX = 2 * 4  # the pipeline's (2,) fp32 auxiliary-loss carry


# ----- the formulas -----------------------------------------------------------------------------
def split_ffns(dec) -> int:
    """Decoder layers whose FFN is split over tp: dense ones, and MoE ones with a shared expert."""
    return sum(1 for i in range(dec.n_layers) if not dec.is_moe(i) or dec.moe.n_shared > 0)


def tp_bytes(dec, rows: int, seq: int, tp: int, cp: int = 1, act_bytes: int = 2, ac: bool = False,
             micro: int = 1) -> dict[str, float]:
    """Bytes one tp rank sends per step, by `Traffic` kind."""
    if tp == 1:
        return {"tp_all_gather": 0.0, "tp_reduce_scatter": 0.0, "tp_rotary_all_gather": 0.0}
    share = (tp - 1) / tp
    V = rows * seq / cp * dec.dim * act_bytes
    per_kind = (dec.n_layers + split_ffns(dec)) * share * V  # collectives of one kind, one pass
    passes = 2 if ac else 1  # forward (+ recompute)
    rotary = 2 * rows * seq / cp * (dec.dim // dec.n_heads // 2) * 4 * share * dec.n_layers
    # all-gathers: forward (and recompute) + the reduce-scatters' backward; reduce-scatters likewise,
    # but the recompute of a dense-FFN layer ends before its last reduce-scatter: torch's
    # non-reentrant checkpoint stops once every saved tensor is back, and nothing after the FFN's
    # w_out is saved (a MoE layer's combine, after its shared expert, saves tensors)
    each = per_kind * (passes + 1) * micro
    dense = sum(1 for i in range(dec.n_layers) if not dec.is_moe(i))
    skipped = dense * share * V * micro if ac else 0.0
    return {"tp_all_gather": each, "tp_reduce_scatter": each - skipped,
            "tp_rotary_all_gather": rotary * passes * micro}


def pp_bytes(dec, rows: int, seq: int, tp: int = 1, cp: int = 1, act_bytes: int = 2, micro: int = 1,
             middle: bool = True) -> float:
    """Bytes one pipeline stage sends per step: activations forward and gradients backward (a middle
    stage), one direction only for an end stage. Under TP x SP each tp rank sends its own chunk."""
    one = rows * seq / (cp * tp) * dec.dim * act_bytes + AUX
    return one * micro * (2 if middle else 1)


# ----- measured ---------------------------------------------------------------------------------
def _torchrun(nproc: int, args: list[str], timeout: float = 600) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--monitor-interval=0.2", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])}: failed\n{proc.stderr[-3000:]}")


def tp_worker(overrides: list[str], out: str) -> None:
    """One trainer step on rank 0's data slot; rank 0 writes the step's Traffic."""
    import torch

    from mmtrain.config import load_config
    from mmtrain.data_pipelines.loader import build_loader
    from mmtrain.loop.trainer import Trainer
    from mmtrain.parallel.distributed import exit_now, init_distributed, shutdown
    from mmtrain.run_config import RunConfig

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as run:
        cfg = load_config(RunConfig, REPO / "configs/tiny.yaml", [*overrides, f"run_dir={run}"])
        env = init_distributed(cfg.dist, "cpu")
        trainer = Trainer(cfg, verbose=False, env=env)
        batch = next(iter(build_loader(cfg.data, trainer.tokenizer, "train", 0, 1)))
        trainer.train_step(iter([batch]))
        if env.is_main:
            # the one step's (the training loop would move it to `last`)
            Path(out).write_text(json.dumps({"traffic": trainer.traffic.sent,
                                             "rows": int(batch.tokens_BS.shape[0]),
                                             "seq": int(batch.tokens_BS.shape[1])}))
        shutdown()
        exit_now(0)


def pp_worker(config: str, out: str) -> None:
    """tests/mmtrain/pipeline_worker.py's PP run, torch.distributed's point-to-point sends counted."""
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "tests/mmtrain"))
    import pipeline_worker
    from torch.distributed.pipelining import schedules

    sent = {"bytes": 0, "calls": 0, "sizes": []}
    inner = schedules._batch_p2p  # every schedule's point-to-point ops go through it

    def counted(ops, *args, **kwargs):
        for op in ops:
            if op.op is dist.isend:
                sent["bytes"] += op.tensor.numel() * op.tensor.element_size()
                sent["calls"] += 1
                sent["sizes"].append(list(op.tensor.shape))
        return inner(ops, *args, **kwargs)

    schedules._batch_p2p = counted
    staged = Path(out).with_suffix(".ref.json")
    pipeline_worker.main(config, str(staged), "1F1B", 1)
    # the worker's reference run is in-process (no sends): every send counted is the pipeline's
    rank = int(os.environ["RANK"])
    Path(f"{out}.{rank}").write_text(json.dumps(sent))


def measure_tp() -> list[dict]:
    from mmtrain.config import load_config
    from mmtrain.run_config import RunConfig

    rows = []
    for ac in (False, True):
        overrides = [*TINY_TP, f"dist.activation_checkpointing={str(ac).lower()}"]
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "tp.json"
            _torchrun(2, ["-m", "tools.bench.bench_comm_tp_pp", "--_tp", json.dumps(overrides), str(out)])
            got = json.loads(out.read_text())
        cfg = load_config(RunConfig, REPO / "configs/tiny.yaml", overrides)
        want = tp_bytes(cfg.model.decoder, got["rows"], got["seq"], 2, act_bytes=4, ac=ac)
        rows.append({"mesh": f"TP(2){' +AC' if ac else ''}", "measured": got["traffic"], "formula": want})
    return rows


def measure_pp() -> dict:
    import yaml

    from mmtrain.config import load_config, to_dict
    from mmtrain.run_config import RunConfig

    overrides = ["data.batch_size=2", "train.grad_accum=2", "train.log_every=1",
                 "model.visual_head=false", "loss.visual_next.weight=0"]  # (a whole-model term)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(RunConfig, REPO / "configs/tiny.yaml", [*overrides, f"run_dir={tmp}/run"])
        config = Path(tmp) / "pp.yaml"
        config.write_text(yaml.safe_dump(to_dict(cfg)))
        out = Path(tmp) / "pp.json"
        _torchrun(2, ["-m", "tools.bench.bench_comm_tp_pp", "--_pp", str(config), str(out)])
        got = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    dec, rows, seq = cfg.model.decoder, cfg.data.batch_size, cfg.data.seq_len
    want = pp_bytes(dec, rows, seq, act_bytes=4, micro=cfg.train.grad_accum, middle=False)
    return {"mesh": "PP(2) 1F1B, 2 micro-batches", "measured": [g["bytes"] for g in got], "formula": want,
            "sends": [g["calls"] for g in got], "shapes": [g["sizes"] for g in got]}


# ----- computed at real shapes ----------------------------------------------------------------------
def ep_bytes(dec, tokens: float, ep: int, layers: int, act_bytes: int = 2) -> float:
    """EP all-to-all, uniform routing, forward + backward (bench_comm.py's convention: no recompute):
    dispatch and combine of the T x top_k x (ep - 1) / ep rows that leave a rank, per MoE layer."""
    rows = tokens * dec.moe.top_k * (ep - 1) / ep
    return 2 * 2 * rows * dec.dim * act_bytes * layers


def cp_bytes(dec, tokens: float, cp: int, layers: int, ac: bool, act_bytes: int = 2) -> float:
    """CP's ceiling: every layer all-gathers the row's K and V (the sparse layers' fetch is at most
    this, docs/BENCHMARKS.md), reduce-scatters their gradients, and regathers in the recompute."""
    kv = 2 * dec.n_kv_heads * (dec.dim // dec.n_heads) * act_bytes  # bytes a token of K and V
    return (cp - 1) * tokens * kv * layers * (3 if ac else 2)  # tokens: this rank's of the row


def compute() -> list[dict]:
    """Per GPU per step, each dim alone beside data parallelism (the row's tokens a data slot holds:
    data.batch_size x data.seq_len; a GPU holds L / pp layers)."""
    from mmtrain.config import load_config
    from mmtrain.run_config import RunConfig

    out = []
    for name, tp, pp, ep, cp in (("base", 2, 2, 8, 2), ("m3", 2, 4, 32, 2)):
        cfg = load_config(RunConfig, REPO / f"configs/{name}.yaml")
        dec, rows, seq = cfg.model.decoder, cfg.data.batch_size, cfg.data.seq_len
        micro, ac = cfg.train.grad_accum, cfg.dist.activation_checkpointing
        moe_layers = sum(1 for i in range(dec.n_layers) if dec.is_moe(i))
        t = tp_bytes(dec, rows, seq, tp, 1, 2, ac, micro)
        GiB = 2**30
        out.append({
            "config": name, "rows": rows, "seq": seq, "dim": dec.dim, "layers": dec.n_layers,
            "moe_layers": moe_layers, "micro": micro, "ac": ac,
            f"tp{tp}_GiB (all layers)": sum(t.values()) / GiB,
            f"tp{tp}_GiB (L / {pp} layers, beside pp {pp})": sum(t.values()) / pp / GiB,
            f"pp{pp}_middle_stage_MiB": pp_bytes(dec, rows, seq, 1, 1, 2, micro) / 2**20,
            f"pp{pp}_middle_stage_MiB (beside tp {tp}, SP chunk)":
                pp_bytes(dec, rows, seq, tp, 1, 2, micro) / 2**20,
            f"ep{ep}_GiB (all layers)": ep_bytes(dec, rows * seq * micro, ep, moe_layers) / GiB,
            f"ep{ep}_GiB (tp {tp} pp {pp}: T / tp, L / pp)":
                ep_bytes(dec, rows * seq * micro / tp, ep, moe_layers) / pp / GiB,
            f"cp{cp}_GiB (all layers, all-gather ceiling)":
                cp_bytes(dec, rows * seq * micro / cp, cp, dec.n_layers, ac) / GiB})
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["all", "measure", "compute"], default="all")
    p.add_argument("--_tp", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--_pp", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._tp:
        return tp_worker(json.loads(a._tp[0]), a._tp[1])
    if a._pp:
        return pp_worker(*a._pp)
    if a.part in ("all", "measure"):
        for r in measure_tp():
            print(json.dumps(r))
            assert all(r["measured"].get(k, 0) == v for k, v in r["formula"].items()), "TP"
        r = measure_pp()
        print(json.dumps(r))
        assert max(r["measured"]) == r["formula"], "PP: measured != formula"
    if a.part in ("all", "compute"):
        for r in compute():
            print(json.dumps(r))


if __name__ == "__main__":
    main()
