"""Bytes moved per step and per device: expert parallelism vs FSDP-gathered experts, and context
parallelism's selective K/V fetch vs an all-gather of K/V.

    python -m tools.bench.bench_comm                        # all three parts below (~3 min, 2 cores)
    python -m tools.bench.bench_comm --part measure         # tiny model, 2 and 4 gloo ranks
    python -m tools.bench.bench_comm --part compute         # the small/base meshes, by the formula
    python -m tools.bench.bench_comm --part cp --seq 131072 1048576

measure: the tiny config's model (`configs/tiny.yaml`, vocab 512, 2 rows x 256 text tokens per
  rank, fp32 on CPU) trains one step (forward, backward, expert-gradient scaling, clipping) under
  torchrun on gloo at several meshes, through `mmtrain.parallel.parallelize.build_model`. Every
  all-gather, reduce-scatter, all-reduce and all-to-all call is counted (torch.distributed's
  functions wrapped) and turned into wire bytes per rank with the ring factors below; the EP
  all-to-all also by the trainer's own `Traffic`. The same numbers come from `formula()` on the
  model's parameter shapes (FSDP2's per-parameter padding included) and the routed rows: the
  two sides must agree exactly.
compute: `formula()` at the real dims of `small`/`base` (bf16 all-gathers and activations, fp32
  gradient reductions, the configs' per-rank batch), with the uniform-routing expectation
  (T x top_k x (ep - 1) / ep rows leave a rank).
cp (tools/bench/bench_comm_cp.py): one synthetic row at `long`'s attention settings (selection
  exactly as the model runs it: models/attention/select.py, blocks.sparse_lists); for each of
  cp contiguous chunks, the K/V of the kept blocks that lie in other chunks (the bytes
  models/attention/context.py fetches: equal to what it counts on gloo ranks, tested), against
  the (cp - 1) / cp of the row's K/V an all-gather brings. Queries and keys are random: see
  `cp_row`.

Wire bytes per rank (ring / pairwise algorithms, n ranks in the group, N bytes the full tensor):
all-gather and reduce-scatter (n - 1) / n x N, all-reduce 2 (n - 1) / n x N, all-to-all the rows
sent to other ranks (a rank's own rows never leave it).

Legend: T tokens per rank, K top_k, D model dim, E routed experts, P ep ranks, S row tokens,
A aligned blocks, G kv heads, Bs block size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.bench.bench_comm_cp import part_cp

REPO = Path(__file__).resolve().parents[2]
MEASURED_MESHES = {  # name -> (ranks, dist overrides)
    "FSDP(2)": (2, {}), "EP(2)": (2, {"ep": 2}),
    "FSDP(4)": (4, {}), "FSDP(4)+EP(2)": (4, {"ep": 2}), "EP(4)": (4, {"ep": 4}),
    "HSDP(2x2)+EP(2)": (4, {"dp_replicate": 2, "ep": 2}),
}
TINY_ROWS, TINY_SEQ, TINY_VOCAB = 2, 256, 512
SIDES = ("all_gather", "reduce_scatter", "all_reduce", "a2a")  # measured vs formula, each


# ----- the formula ----------------------------------------------------------------------------
def fsdp_units(model_cfg, ep: int) -> list[dict]:
    """FSDP2 units as mmtrain/parallel/parallelize.py shards them: every vision block and decoder layer
    (its routed experts are a unit of their own, of E / ep experts, when ep > 1), then the root.
    -> [{"name", "root", "params": [(shape, is_expert)], "experts_own_unit"}]."""
    import torch

    from mmtrain.models.multimodal import MultimodalModel

    with torch.device("meta"):
        model = MultimodalModel(model_cfg)
    units, seen = [], set()

    def add(name: str, module, root: bool = False, expert_unit: bool = False) -> None:
        params = []
        for pname, p in module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            expert = ".experts." in f".{name}.{pname}" or expert_unit
            shape = list(p.shape)
            if expert and ep > 1:
                shape[0] //= ep
            params.append((tuple(shape), expert))
        units.append({"name": name, "root": root, "params": params, "experts_own_unit": expert_unit})

    if ep > 1:
        for i, moe in model.moe_layers().items():
            add(f"decoder.layers.{i}.ffn.experts", moe.experts, expert_unit=True)
    for blocks, prefix in ((model.vision.blocks, "vision.blocks"), (model.decoder.layers, "decoder.layers")):
        for i, block in enumerate(blocks):
            add(f"{prefix}.{i}", block)
    add("root", model, root=True)
    return units


def padded(shape: tuple[int, ...], n: int) -> int:
    """FSDP2 shards dim 0 in n equal chunks, padding it to a multiple of n."""
    rest = math.prod(shape[1:])
    return -(-shape[0] // n) * n * rest if shape else n


def formula(model_cfg, mesh: dict, tokens: int, rows: float | None = None, param_bytes: int = 2,
            grad_bytes: int = 4, act_bytes: int = 2, reshard_after_forward: bool = True,
            moe_passes: int = 2, node: int = 8) -> dict[str, float]:
    """Wire bytes per rank for one optimizer step (one micro-batch) at `mesh` = {world,
    dp_replicate, ep} (cp 1): FSDP all-gathers (forward, and again in backward with
    reshard_after_forward, except the root's), reduce-scatters and HSDP all-reduces of the gradients,
    split into the routed experts' and the rest; and the EP all-to-all. A rank sends its rows out
    (dispatch) and the rows it received back (combine); backward repeats both in reverse. `rows`:
    this rank's rows out + rows in over all MoE layers; default the uniform expectation
    2 x T x K x (ep - 1) / ep a layer. `moe_passes`: 3 when the MoE forward is recomputed.
    "inter": the bytes of collectives whose group spans nodes of `node` ranks (ranks numbered
    node by node, as torchrun does; mesh dims row-major, mmtrain/parallel/dims.py)."""
    world, rep, ep = mesh["world"], mesh.get("dp_replicate", 1), mesh.get("ep", 1)
    shard = world // rep
    efsdp = shard // ep
    out = {k: 0.0 for k in ("ag_expert", "ag_other", "rs_expert", "rs_other", "ar_expert", "ar_other",
                            "a2a", "inter")}
    # a group's span in ranks: fsdp = shard contiguous ranks, efsdp = efsdp ranks ep apart,
    # ep = ep contiguous ranks, dp_replicate = rep ranks `shard` apart
    spans = {"fsdp": shard, "efsdp": efsdp * ep if efsdp > 1 else 1, "ep": ep, "rep": world if rep > 1 else 1}
    inter = {k: v > node for k, v in spans.items()}
    for unit in fsdp_units(model_cfg, ep):
        for shape, expert in unit["params"]:
            on = "efsdp" if (expert and ep > 1) else "fsdp"
            n = efsdp if on == "efsdp" else shard
            kind = "expert" if expert else "other"
            numel = padded(shape, n)
            passes = 2 if reshard_after_forward and not unit["root"] else 1  # the root: kept gathered
            ag, rs = passes * numel * (n - 1) / n * param_bytes, numel * (n - 1) / n * grad_bytes
            ar = numel / n * 2 * (rep - 1) / rep * grad_bytes
            out[f"ag_{kind}"] += ag
            out[f"rs_{kind}"] += rs
            out[f"ar_{kind}"] += ar
            out["inter"] += (ag + rs) * inter[on] + ar * inter["rep"]
    moe = model_cfg.decoder.moe
    n_moe = sum(model_cfg.decoder.is_moe(i) for i in range(model_cfg.decoder.n_layers))
    if ep > 1:
        rows = rows if rows is not None else 2 * tokens * moe.top_k * (ep - 1) / ep * n_moe
        out["a2a"] = rows * model_cfg.decoder.dim * act_bytes * moe_passes
        out["inter"] += out["a2a"] * inter["ep"]
    return out


def expert_total(b: dict[str, float]) -> float:
    return b["ag_expert"] + b["rs_expert"] + b["ar_expert"] + b["a2a"]


# ----- measured: a worker under torchrun --------------------------------------------------------
def tiny_model_cfg(vocab: int = TINY_VOCAB):
    from mmtrain.config import load_config
    from mmtrain.run_config import RunConfig

    cfg = load_config(RunConfig, REPO / "configs" / "tiny.yaml")
    cfg.model.decoder.vocab_size = vocab
    cfg.model.visual_head = False  # the measured step is a text-only LM loss: the visual head has no gradient
    return cfg


class Counter:
    """Wraps torch.distributed's collectives; wire bytes per rank by kind (see the module doc)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.bytes, self.calls = dist, {}, {}
        self._orig = {}
        for name in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                     "reduce_scatter_tensor", "all_reduce", "all_to_all_single"):
            self._orig[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name))

    def _add(self, kind: str, nbytes: float) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0.0) + nbytes
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def _wrap(self, name: str):
        orig, dist = self._orig[name], self.dist

        def call(*args, **kw):
            group = kw.get("group")
            n = dist.get_world_size(group)
            if name.startswith("all_gather"):
                out = args[0] if args else kw["output_tensor"]
                self._add("all_gather", out.numel() * out.element_size() * (n - 1) / n)
            elif name.startswith("reduce_scatter"):
                inp = args[1] if len(args) > 1 else kw["input"]
                self._add("reduce_scatter", inp.numel() * inp.element_size() * (n - 1) / n)
            elif name == "all_reduce":
                t = args[0] if args else kw["tensor"]
                kind = "all_reduce" if t.numel() > 1 else "all_reduce_scalar"  # clipping's norms
                self._add(kind, t.numel() * t.element_size() * 2 * (n - 1) / n)
            else:
                inp = args[1] if len(args) > 1 else kw["input"]
                splits = args[3] if len(args) > 3 else kw.get("input_split_sizes")
                row = inp[:1].numel() * inp.element_size() if inp.shape[0] else 0
                me = dist.get_rank(group)
                rows = (sum(splits) - splits[me]) if splits else inp.shape[0] * (n - 1) / n
                kind = "a2a_counts" if not inp.is_floating_point() else "a2a_rows"
                self._add(kind, rows * row)
            return orig(*args, **kw)

        return call


class RowCounter:
    """Wraps an AllToAllDispatcher: per ep rank, the rows this rank's forwards route to its
    experts (padding is routed nowhere)."""

    def __init__(self, inner) -> None:
        self.inner, self.to_P = inner, [0] * inner.P

    def __call__(self, experts, x_TD, idx_TK, w_TK):
        owner = idx_TK[idx_TK < self.inner.E] // self.inner.L
        for p, n in enumerate(owner.bincount(minlength=self.inner.P).tolist()):
            self.to_P[p] += n
        return self.inner(experts, x_TD, idx_TK, w_TK)

    def chunks(self, *args) -> int:
        return self.inner.chunks(*args)


def worker(mesh: dict, out: str) -> None:
    import torch
    import torch.distributed as dist

    from mmtrain.parallel.comm import Traffic
    from mmtrain.parallel.dims import ParallelDims
    from mmtrain.parallel.distributed import init_distributed
    from mmtrain.parallel.parallelize import build_model, clip_grad_norm, scale_expert_grads

    torch.set_num_threads(1)
    cfg = tiny_model_cfg()
    for key, value in mesh.items():
        setattr(cfg.dist, key, value)
    env = init_distributed(cfg.dist, "cpu")
    dims = ParallelDims.from_config(cfg.dist, env.world_size, env.rank)
    traffic = Traffic()
    counter = Counter()
    torch.manual_seed(cfg.train.seed)  # every rank builds the same model (as the trainer does)
    model, fwd = build_model(cfg, env, torch.device("cpu"), dims, traffic)
    counters = []
    for moe in model.moe_layers().values():
        if hasattr(moe.dispatcher, "group"):
            moe.dispatcher = RowCounter(moe.dispatcher)
            counters.append(moe.dispatcher)
    counter.bytes, counter.calls = {}, {}  # the step only, not the setup
    gen = torch.Generator().manual_seed(1000 + env.rank)
    B, S = TINY_ROWS, TINY_SEQ
    tokens = torch.randint(3, TINY_VOCAB, (B, S), generator=gen)
    doc = (torch.arange(S) // 64).expand(B, S).clone()
    doc[:, -16:] = -1  # padding: routed nowhere, never sent
    batch = dict(tokens_BS=tokens, pos_ids_3BS=(torch.arange(S) % 64).expand(3, B, S).contiguous(),
                 doc_ids_BS=doc, span_ids_BS=torch.full((B, S), -1),
                 modality_BS=torch.zeros(B, S, dtype=torch.long),
                 patches_NP=torch.zeros(0, cfg.model.vision.patch_dim),  # no media: a blank frame
                 grid_thw_M3=torch.zeros(0, 3, dtype=torch.long))
    o = fwd(**batch)
    loss = torch.nn.functional.cross_entropy(o.logits_BSV.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
    (loss + sum(o.aux_losses.values())).backward()
    scale_expert_grads(model, dims)
    clip_grad_norm(model, 1.0)
    real = int((doc >= 0).sum())
    result = {"bytes": counter.bytes, "calls": counter.calls, "traffic": traffic.sent,
              "rows_to": [sum(c.to_P[p] for c in counters) for p in range(dims.ep)],
              "ep_rank": counters[0].inner.me if counters else 0, "real_tokens": real}
    gathered = [None] * env.world_size
    dist.all_gather_object(gathered, result)
    if env.rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def measure(name: str, nproc: int, mesh: dict, timeout: float = 300) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--monitor-interval=0.2", "-m", "tools.bench.bench_comm", "--_worker", json.dumps(mesh),
               str(out)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{name}: the {nproc}-rank worker failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def compare(name: str, nproc: int, mesh: dict, ranks: list[dict]) -> dict:
    """Measured (rank 0 and the mean over ranks) against the formula at the routed rows."""
    cfg = tiny_model_cfg()
    full = {"world": nproc, **mesh}
    r0 = ranks[0]
    me, group = r0["ep_rank"], mesh.get("ep", 1)
    peers = ranks[1:group]  # rank 0's ep group: world ranks 0 .. ep - 1 (ep is the innermost dim)
    rows = (sum(r0["rows_to"]) - r0["rows_to"][me]) + sum(r["rows_to"][me] for r in peers)  # out + in
    f = formula(cfg.model, full, r0["real_tokens"], rows=rows, param_bytes=4, grad_bytes=4, act_bytes=4)
    f_uniform = formula(cfg.model, full, r0["real_tokens"], param_bytes=4, grad_bytes=4, act_bytes=4)
    got = r0["bytes"]
    return {"mesh": name, "ranks": nproc,
            "all_gather": (got.get("all_gather", 0.0), f["ag_expert"] + f["ag_other"]),
            "reduce_scatter": (got.get("reduce_scatter", 0.0), f["rs_expert"] + f["rs_other"]),
            "all_reduce": (got.get("all_reduce", 0.0), f["ar_expert"] + f["ar_other"]),
            "a2a": (r0["traffic"].get("ep_all_to_all", 0.0), f["a2a"]),
            "a2a_counted": got.get("a2a_rows", 0.0),
            "expert_formula": expert_total(f), "expert_uniform": expert_total(f_uniform),
            "a2a_uniform": f_uniform["a2a"], "f": f}


def part_measure(meshes: list[str]) -> list[dict]:
    rows = []
    for name in meshes:
        nproc, mesh = MEASURED_MESHES[name]
        rows.append(compare(name, nproc, mesh, measure(name, nproc, mesh)))
    print("\n### Measured: the tiny model, one step, gloo (rank 0's wire bytes; formula in brackets)\n")
    print("| mesh | all-gather KiB | reduce-scatter KiB | HSDP all-reduce KiB | EP all-to-all KiB "
          "| experts' share, formula KiB | sides agree |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ok = all(abs(r[k][0] - r[k][1]) <= 1e-6 * max(1.0, r[k][1]) for k in SIDES)
        ok = ok and abs(r["a2a_counted"] - r["a2a"][0]) <= 1e-6 * max(1.0, r["a2a"][0])
        cells = [f"{r[k][0] / 1024:.1f} ({r[k][1] / 1024:.1f})" for k in SIDES[:3]]
        a2a, uni = r["a2a"], r["a2a_uniform"]
        cells.append(f"{a2a[0] / 1024:.1f} ({a2a[1] / 1024:.1f}; uniform {uni / 1024:.1f})")
        cells += [f"{r['expert_formula'] / 1024:.1f}", "yes" if ok else "NO"]
        print(f"| {r['mesh']} | {' | '.join(cells)} |")
        r["agree"] = ok
    return rows


# ----- computed at the real dims ---------------------------------------------------------------
COMPUTED = {  # config -> [(mesh name, mesh)]
    "small": [("FSDP(8)", {"world": 8}), ("FSDP(8)+EP(8)", {"world": 8, "ep": 8})],
    "base": [("FSDP(8)", {"world": 8}), ("FSDP(8)+EP(8)", {"world": 8, "ep": 8}),
             ("FSDP(32)", {"world": 32}), ("FSDP(32)+EP(8)", {"world": 32, "ep": 8}),
             ("HSDP(4x8)", {"world": 32, "dp_replicate": 4}),
             ("HSDP(4x8)+EP(8)", {"world": 32, "dp_replicate": 4, "ep": 8})],
}


def real_cfg(name: str):
    from mmtrain.config import load_config
    from mmtrain.run_config import RunConfig

    cfg = load_config(RunConfig, REPO / "configs" / f"{name}.yaml")
    cfg.model.decoder.vocab_size = cfg.model.decoder.vocab_size or 32768
    return cfg


def part_compute() -> None:
    print("\n### Computed: the real dims (bf16 gathers and activations, fp32 gradient reductions)\n")
    print("| config | mesh | tokens/rank | experts: all-gather GB | reduce-scatter GB | HSDP all-reduce GB "
          "| EP all-to-all GB | experts total GB | rest of the model GB | experts vs no EP "
          "| all of it across nodes GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    notes = []
    for name, meshes in COMPUTED.items():
        cfg = real_cfg(name)
        T = cfg.data.seq_len * cfg.data.batch_size
        ref = {}
        for mesh_name, mesh in meshes:
            b = formula(cfg.model, mesh, T)
            key = (mesh["world"], mesh.get("dp_replicate", 1))
            ref.setdefault(key, expert_total(b))
            other = b["ag_other"] + b["rs_other"] + b["ar_other"]
            print(f"| {name} | {mesh_name} | {T} | {b['ag_expert'] / 1e9:.2f} | {b['rs_expert'] / 1e9:.2f} | "
                  f"{b['ar_expert'] / 1e9:.2f} | {b['a2a'] / 1e9:.2f} | {expert_total(b) / 1e9:.2f} | "
                  f"{other / 1e9:.2f} | {expert_total(b) / ref[key]:.2f}x | {b['inter'] / 1e9:.2f} |")
        moe, D = cfg.model.decoder.moe, cfg.model.decoder.dim
        per_layer = 3 * moe.n_routed * D * moe.expert_dim
        # FSDP(n) of one layer's experts: 2 x AG (bf16) + RS (fp32) = 8 (n-1)/n bytes a parameter;
        # EP(P): T K (P-1)/P rows x D x 2 bytes x 2 directions x 2 passes.
        for n, P in ((8, 8),):
            cross = 8 * (n - 1) / n * per_layer / (moe.top_k * (P - 1) / P * D * 2 * 2 * 2)
            ratio = (moe.top_k * (P - 1) / P * D * 8 * T) / (8 * (n - 1) / n * per_layer)
            notes.append(f"{name}: EP({P}) moves fewer bytes than FSDP({n})-gathered experts below "
                         f"{cross:,.0f} tokens per rank per step (computed; at {T}: {ratio:.2f}x the bytes)")
    print("\n" + "\n".join(notes))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["all", "measure", "compute", "cp"], default="all")
    p.add_argument("--meshes", nargs="+", default=list(MEASURED_MESHES), choices=list(MEASURED_MESHES))
    p.add_argument("--seq", type=int, nargs="+", default=[65536, 131072, 1048576])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 8, 32])
    p.add_argument("--cp-head-dim", type=int, default=32,
                   help="head dim of the random q/k (picks do not depend on it; the bytes use the real one)")
    p.add_argument("--_worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._worker:
        return worker(json.loads(args._worker[0]), args._worker[1])
    if args.part in ("all", "measure"):
        part_measure(args.meshes)
    if args.part in ("all", "compute"):
        part_compute()
    if args.part in ("all", "cp"):
        rows = [("one text document", 0, 0), ("text documents of 20k", 20000, 0),
                ("one document, a 1024-token image every 16k", 0, 16384)]
        part_cp(real_cfg("long"), args.seq, args.cp, rows, args.cp_head_dim)


if __name__ == "__main__":
    main()
