"""Pipeline parallelism in the plan: the reported rank's stages traced, the schedule in closed form.

The split is the trainer's (mmtrain/parallel/pipeline.py: `stage_costs` on the full model,
`split_layers` with `dist.pp_vision_stage`, `stage_ids` of `dist.pp_schedule`). What is traced is
this rank's decoder layers (all its stages' layers, in order) on the rank's data-parallel world
(gpus / pp ranks: pp is the outermost mesh dim, so a stage's dp ranks are a contiguous block), one
micro-batch, by the plan's usual trace (one layer per kind, scaled). Stated, not traced:

- every stage is traced holding the vision encoder, the embedding and the LM head (only stage 0 /
  the last stage hold them, the visual head too), their parameter,
  gradient and optimizer-state bytes are taken off the stages that lack them (`absent_numel`, fp32
  sharded over the stage's dense mesh, dp_shard x cp x tp, as the trainer's `shard_blocks`), so
  the rank's bytes at rest are its stages' (tests/mmtrain/test_plan_pipeline.py compares them
  with the trainer's PipelineModel); their activations stay an upper bound, their FLOPs are
  counted only on the stages that hold them;
- `dist.pp_split: measured` cuts by times the trainer takes on the devices at launch: the plan
  cannot time, so it plans the FLOP split and says so (`split_by`);
- a rank whose stages hold no decoder layer (the vision stage of 1F1B / GPipe under
  `dist.pp_vision_stage`) is traced with one layer (the model needs one): its memory and traffic
  an upper bound, its FLOPs not counted;
- memory: the traced micro-batch's activations (all the rank's layers) x the micro-batches in flight
  at the peak, in those units (m micro-batches: `grad_accum` x the trainer's row parts,
  `pipeline.row_parts`, each of `rows` rows), as torch's schedules order them (`in_flight`;
  tests/mmtrain/test_plan.py counts the forwards not yet backwarded in torch's own per-rank action
  lists): GPipe all m; 1F1B pp - rank; Interleaved1F1B (its warm-up forwards + 1) / v, the warm-up being
  (v - 1) x the micro-batches a round + 2 (pp - 1 - rank) stage-forwards; ZBVZeroBubble
  min(2 pp, m + 1 + rank) stage-forwards (pp rank-units once m >= 2 pp - 1); DualPipeV is
  planned as ZBVZeroBubble, unverified;
- per step: FLOPs, every per-layer collective x m: all-to-alls, all-gathers (FSDP
  reshards after each micro-batch's forward) and every collective on the tp / cp / seq groups
  (the activations' all-gathers and reduce-scatters); FSDP's gradient reduce-scatters, HSDP's
  all-reduce, the loop's norms and sums and the optimizer once;
- send / recv: each micro-batch sends the residual stream (B x s x D, the rank's sequence chunk,
  bf16 under CUDA bf16 else fp32) and the (2,) auxiliary-loss tensor across every stage boundary
  this rank feeds, forward; its gradient the other way in backward;
- bubble: the closed form (pp - 1) / (v m + pp - 1), m micro-batches, v stages a rank (GPipe and
  1F1B: v = 1; Interleaved1F1B v = 2; the zero-bubble V schedules are given the same, an upper
  bound); the roofline's compute time is divided by (1 - bubble).
"""

from __future__ import annotations

import copy

import torch

PER_MB = ("all_to_all", "all_gather")  # collective kinds issued once per micro-batch, on any group
PER_MB_GROUPS = {"tp", "cp", "seq"}  # groups whose every collective moves activations: per micro-batch
GRAD_GROUPS = {"fsdp", "efsdp", "efsdp_tp", "dp_replicate"}  # ... unless FSDP's gradients share the group
# flops.component_flops' decoder-layer components
LAYER_FLOPS = ("full attention", "sparse attention", "dense ffn", "moe experts", "shared experts", "router")


def stage_plan(cfg, dims) -> dict:
    """{"stages", "layers", "n_stages", "schedule", "microbatches", "in_flight", "bubble",
    "absent_numel"} of this rank."""
    from mmtrain.models.multimodal import MultimodalModel
    from mmtrain.parallel.pipeline import row_parts, stage_ids, stage_ranges, stages_per_rank

    schedule, pp = cfg.dist.pp_schedule, dims.pp
    parts = row_parts(schedule, pp, cfg.data.batch_size, cfg.train.grad_accum)  # the trainer's split
    m = cfg.train.grad_accum * parts
    v = stages_per_rank(schedule)
    with torch.device("meta"):
        model = MultimodalModel(cfg.model)
    ranges = stage_ranges(model, schedule, pp, cfg.data.seq_len, cfg.dist.pp_vision_stage)  # the trainer's
    mine = stage_ids(schedule, dims.pp_rank, pp)
    layers = [i for s in mine for i in ranges[s]]
    in_flight = micro_batches_in_flight(schedule, pp, dims.pp_rank, m)
    return {"schedule": schedule, "stages": mine, "n_stages": pp * v, "layers": layers,
            "split": [[r.start, r.stop] for r in ranges], "split_by": cfg.dist.pp_split,
            "microbatches": m, "rows": cfg.data.batch_size // parts, "in_flight": in_flight,
            "bubble": (pp - 1) / (v * m + pp - 1), "absent_numel": absent_numel(model, ranges, mine)}


def absent_numel(model, ranges: list[range], stages: list[int]) -> int:
    """Parameters (and persistent buffers) of the blocks besides the decoder layers (which the traced
    stage holds as the rank's) that `stages` do not hold, placed as the trainer places them."""
    from mmtrain.parallel.pipeline import block_stage
    from mmtrain.parallel.pipeline_replica import block_modules

    return sum(t.numel() for name, block in block_modules(model).items()
               if not name.startswith("decoder.layers.") and block_stage(name, ranges) not in stages
               for t in block.state_dict().values())


def micro_batches_in_flight(schedule: str, pp: int, rank: int, m: int) -> float:
    """The most micro-batches whose activations rank `rank` holds at once, in units of one micro-batch
    through all its stages (a stage-forward of a v-stage rank is 1 / v of one): module docstring."""
    if schedule == "GPipe":
        return float(m)
    if schedule == "1F1B":
        return float(min(m, pp - rank))
    if schedule == "Interleaved1F1B":
        v = 2
        per_round = m // max(1, m // pp)
        warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
        return min(warmup + 1, m * v) / v
    # ZBVZeroBubble (and DualPipeV, planned alike): its warm-up forwards, at most 2 pp stage-forwards
    return min(2 * pp, m + 1 + rank, 2 * m) / 2


def stage_config(cfg, info: dict):
    """A copy of cfg whose decoder is this rank's layers, one micro-batch, no pp (the traced stage)."""
    from mmtrain.plan.layers import reduced

    kinds = cfg.model.decoder.layer_kinds()
    ids = info["layers"] or [0]  # a vision stage alone: one layer traced, its FLOPs dropped (`pipelined`)
    out = reduced(cfg, [kinds[i] for i in ids], cfg.model.vision.depth)
    out.dist.pp, out.train.grad_accum = 1, 1
    out.data.batch_size = info["rows"]  # a micro-batch: a row part of a batch when the trainer splits
    return out


def _per_micro_batch(group: str, kind: str) -> bool:
    """Whether the traced micro-batch's (group, kind) repeats in every micro-batch. A group that is
    both tp's and FSDP's (e.g. "fsdp/tp/seq" when the data-parallel size is 1) mixes TP's per-layer
    reduce-scatters with FSDP's once-a-step gradient one: counted once, an under-count stated here."""
    roles = set(group.split("/"))
    return kind in PER_MB or bool(roles & PER_MB_GROUPS and not roles & GRAD_GROUPS)


def pipelined(trace, info: dict, cfg, dims, per_node: int):
    """The traced stage's Trace -> the rank's under the schedule (module docstring)."""
    out = copy.copy(trace)
    m = info["microbatches"]
    n = info["n_stages"]
    absent = ({"vit"} if 0 not in info["stages"] else set()) | \
        ({"lm head", "visual head"} if n - 1 not in info["stages"] else set()) | \
        (set(LAYER_FLOPS) if not info["layers"] else set())  # not on this rank's stages
    out.flops = {k: 0.0 if k in absent else v * m for k, v in trace.flops.items()}
    out.comm = {k: [c * m, b * m] if _per_micro_batch(*k) else list(v) for k, v in trace.comm.items()
                for c, b in [v]}
    out.peak = dict(trace.peak)
    out.peak["activations"] = trace.peak.get("activations", 0) * info["in_flight"]
    absent = info["absent_numel"] * 4 / (dims.dp_shard * dims.cp * dims.tp)  # fp32 at rest, sharded
    for key, per in (("parameters", 1), ("gradients", 1), ("optimizer state", 2)):  # AdamW: 2 moments
        if out.peak.get(key):  # gradients: absent where the peak comes before the backward
            out.peak[key] = max(0.0, out.peak[key] - per * absent)
    cuda_bf16 = cfg.train.device == "cuda" and cfg.train.dtype == "bfloat16"
    width = 2 if cuda_bf16 else 4
    h = info["rows"] * (cfg.data.seq_len // dims.seq_size) * cfg.model.decoder.dim * width + 2 * 4
    sends = sum((s < n - 1) + (s > 0) for s in info["stages"]) * m  # forward out, backward out
    out.comm[("pp", "send_recv")] = [sends, float(sends * h)]
    out.mesh = {**trace.mesh, "pp": dims.pp}
    # pp is the outermost dim: a stage's peer is world / pp ranks away
    out.crosses = {**trace.crosses, "pp": dims.world_size // dims.pp >= per_node}
    out.pipeline = info
    return out
