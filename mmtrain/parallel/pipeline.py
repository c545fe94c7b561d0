"""Pipeline parallelism: the real model cut into stages, run by `torch.distributed.pipelining`.

    costs = stage_costs(model, seq_len, visual_fraction)    # FLOPs per token: vision, each layer, head
    ranges = split_layers(costs, n_stages, vision_stage)   # contiguous decoder layers per stage
    parts = build_stage_models(meta_model, name, pp_rank, pp, seq_len)  # pruned copies, then `materialize`
    schedule = build_schedule(name, stages, n_microbatches, loss_fn)

The split (torchtitan's `pipeline_module_split`: each stage a pruned copy of the whole model, so
parameter names are the full model's and a checkpoint reshards): stage 0 holds the vision encoder
and the token embedding, every stage a contiguous slice of the decoder layers, the last one the
final norm and the LM head (the loss runs there, as the schedule's loss_fn). Where the layers are
cut comes from a stated cost model, `stage_costs`: training FLOPs per decoder token of each layer
(6 x its active matmul parameters + 12 x heads x head_dim x the keys a query reads, as
`models/counting.flops_per_token`), the vision encoder's FLOPs per decoder token (its per-patch
cost x merge^2 x the visual fraction) counted on stage 0, the LM head's (6 x D x V) on the last;
`split_layers` then minimises the largest stage's cost.

`dist.pp_vision_stage` gives the encoder a stage of its own (as torchtitan's open Kimi-K3 PR does):
stage 0 holds the vision encoder, its projector and the token embedding and no decoder layer (the
embedding rides with the encoder: the visual tokens are scattered into the embedded row there), and
the decoder layers split over stages 1..n-1, minimising the largest of those. The stage count stays
pp x stages a rank (the schedules need a multiple of pp), so 1F1B at pp 2 puts every layer on stage 1.
`dist.pp_split: measured` hands `split_layers` times in place of FLOPs (mmtrain/parallel/stage_timing.py).

What crosses a stage boundary: the residual stream h_BSD and a (2,) tensor of the MoE auxiliary
losses summed over the layers so far (moe_seq_balance, router_z): it rides along the activations,
so the last stage adds it to the loss and its gradient flows back through every stage exactly as
in one process. The per-row metadata (document ids, span ids, modality, M-RoPE positions) is NOT
sent: every rank of a pipeline reads the same micro-batch (the pp ranks share a data rank), the
schedule hands every stage the batch's tensors as keyword arguments, and each stage rebuilds the
attention metadata (`build_meta`) and the rotary tables from them itself, as the decoder does once
per forward. Patches reach only stage 0's vision encoder. Under tensor parallelism a stage holds
its tp rank's chunk of every row (`StageModel.context`, sequence parallelism): stage 0 embeds the
chunk's tokens, and the chunk (B, S / tp, D) crosses the boundary; the metadata stays the whole rows'.

Legend: B rows, S tokens, D decoder width, V vocabulary, L decoder layers, N patches, M media.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from mmtrain.errors import UserError
from mmtrain.models.attention import build_meta
from mmtrain.models.attention.context import ContextShard
from mmtrain.models.counting import _inactive_routed, _matmul_params, attention_keys, flops_per_token
from mmtrain.models.moe import MoE
from mmtrain.models.multimodal import MultimodalModel, seeded_init
from mmtrain.parallel import pipeline_p2p
from mmtrain.parallel.parallelize import _by_mesh, checkpoint_forward, global_norm, layer_graphs, prime_probes

Tensor = torch.Tensor

# dist.pp_schedule -> torch's schedule; the V-shaped ones place stages r and 2 pp - 1 - r on rank r
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B,
             "ZBVZeroBubble": ScheduleZBVZeroBubble, "DualPipeV": ScheduleDualPipeV}
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
AUX_NAMES = ("moe_seq_balance", "router_z")  # the MoE aux losses, summed over the stages' layers
# what crosses each stage boundary beside the hidden states (carry_C, fp32): the MoE aux losses and
# stage 0's masked-patch loss (loss.visual_ssl), so that the last stage's loss holds them all and
# their gradients flow back to the stages that made them
CARRIED = (*AUX_NAMES, "visual_ssl")


def check_pipeline_config(cfg, dims) -> None:
    """One-line refusals of what pipeline parallelism does not compose with (yet), naming the key."""
    d = cfg.dist
    if dims.pp <= 1:
        return
    if d.pp_schedule == "DualPipeV" and dims.ep > 1:
        raise UserError("dist.pp_schedule: DualPipeV overlaps one micro-batch's forward with another's "
                        "backward, which needs an F/B overlap of the expert all-to-alls (dist.ep > 1) "
                        "that is not implemented; use ZBVZeroBubble or Interleaved1F1B")
    n_stages = dims.pp * stages_per_rank(d.pp_schedule)
    if d.pp_vision_stage and cfg.model.decoder.n_layers < n_stages - 1:
        raise UserError(f"dist.pp_vision_stage: the {n_stages - 1} stages after the vision stage ({dims.pp} "
                        f"ranks x {stages_per_rank(d.pp_schedule)} a rank, {d.pp_schedule}) need as many "
                        f"decoder layers (model.decoder.n_layers is {cfg.model.decoder.n_layers})")
    if not d.pp_vision_stage and cfg.model.decoder.n_layers < n_stages:
        raise UserError(f"dist.pp: {dims.pp} ranks x {stages_per_rank(d.pp_schedule)} stages a rank "
                        f"({d.pp_schedule}) need as many decoder layers (model.decoder.n_layers is "
                        f"{cfg.model.decoder.n_layers})")


def schedule_class(name: str):
    if name not in SCHEDULES:
        raise UserError(f"dist.pp_schedule: one of {', '.join(SCHEDULES)} (got {name!r})")
    return SCHEDULES[name]


def row_parts(schedule: str, pp: int, rows: int, accum: int) -> int:
    """Into how many equal row parts each of a step's `accum` batches is split so that the schedule
    has the micro-batches it needs: one a rank (DualPipeV: one a stage), torchtitan's default of
    splitting the batch into the pipeline's micro-batches. 1 when `train.grad_accum` gives enough;
    else the fewest parts dividing `rows` (the stages' shapes are static: every part equal)."""
    need = 2 * pp if schedule == "DualPipeV" else pp
    if accum >= need:
        return 1
    for parts in range(-(-need // accum), rows + 1):
        if rows % parts == 0:
            return parts
    raise UserError(f"data.batch_size: {rows} rows x train.grad_accum {accum} make fewer than the {need} "
                    f"micro-batches dist.pp_schedule {schedule} needs at dist.pp {pp}; raise either")


def stages_per_rank(name: str) -> int:
    return 1 if issubclass(schedule_class(name), PipelineScheduleSingle) else 2


def stage_ids(name: str, pp_rank: int, pp: int) -> list[int]:
    """The stages rank `pp_rank` runs: itself (single-stage schedules), r, r + pp, ... (looped) or
    r and 2 pp - 1 - r (V-shaped: the first and last stage on rank 0, so the loss is next to the input)."""
    k = stages_per_rank(name)
    if name in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(k)]


# ----- the cost model and the split ----------------------------------------------------------------
def stage_costs(model: MultimodalModel, seq_len: int, visual_fraction: float = 0.25,
                patches_per_medium: int = 256) -> dict:
    """Training FLOPs per decoder token: {"vision": the encoder + projector (on stage 0), "layers":
    one per decoder layer, "head": the LM head (on the last stage)}. The visual fraction (share of a
    row's tokens that are visual) scales the encoder: its cost is per patch, not per decoder token."""
    dec = model.cfg.decoder
    vision = flops_per_token(model, seq_len, visual_fraction, patches_per_medium) - flops_per_token(
        model, seq_len, 0.0, patches_per_medium)
    layers = []
    for i, layer in enumerate(model.decoder.layers):
        inactive = _inactive_routed_layer(layer)
        attn = 12 * dec.n_heads * dec.head_dim * attention_keys(model, i, seq_len)
        layers.append(6 * (_matmul_params(layer) - inactive) + attn)
    return {"vision": vision, "layers": layers, "head": 6 * dec.dim * dec.vocab_size}


def _inactive_routed_layer(layer: nn.Module) -> int:
    holder = nn.Module()
    holder.moe_layers = lambda: {0: layer.ffn} if isinstance(layer.ffn, MoE) else {}
    return _inactive_routed(holder)


def split_layers(costs: dict, n_stages: int, vision_stage: bool = False) -> list[range]:
    """Contiguous decoder layers per stage (at least one each) minimising the largest stage cost,
    the vision encoder's cost added to stage 0 and the head's to the last (exact: dynamic programming).
    vision_stage: stage 0 holds no layer (range(0, 0)); stages 1..n-1 split them, minimising the
    largest of those (the encoder's cost is stage 0's alone, whatever the cut)."""
    if vision_stage:
        if n_stages < 2:
            raise UserError(f"dist.pp_vision_stage: needs at least 2 pipeline stages (got {n_stages}); "
                            f"set dist.pp >= 2 or dist.pp_vision_stage: false")
        if n_stages - 1 > len(costs["layers"]):
            raise UserError(f"dist.pp_vision_stage: the {n_stages - 1} stages after the vision stage need "
                            f"as many decoder layers (model.decoder.n_layers is {len(costs['layers'])})")
        return [range(0, 0), *split_layers({**costs, "vision": 0.0}, n_stages - 1)]
    c = costs["layers"]
    L = len(c)
    if n_stages > L:
        raise UserError(f"dist.pp: {n_stages} stages need at least {n_stages} decoder layers "
                        f"(model.decoder.n_layers is {L})")
    prefix = [0.0]
    for x in c:
        prefix.append(prefix[-1] + x)

    def cost(s: int, lo: int, hi: int) -> float:
        extra = (costs["vision"] if s == 0 else 0.0) + (costs["head"] if s == n_stages - 1 else 0.0)
        return prefix[hi] - prefix[lo] + extra

    # best[s][j]: the smallest max cost of stages 0..s-1 holding layers [0, j); cut[s][j] its last cut
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (L + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for j in range(s, L - (n_stages - s) + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], cost(s - 1, i, j))
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    bounds, j = [], L
    for s in range(n_stages, 0, -1):
        bounds.append(range(cut[s][j], j))
        j = cut[s][j]
    return bounds[::-1]


# ----- a stage ---------------------------------------------------------------------------------------
class StageModel(nn.Module):
    """One pipeline stage: a pruned copy of the model (its own parameters keep the full model's names:
    `vision.*`, `decoder.embed.*`, `decoder.layers.<i>.*`, `decoder.norm.*`, `decoder.lm_head.*`).

    forward(x, carry_C=None, **model_inputs) -> (h_BSD, carry_C): x is tokens_BS on stage 0, the
    previous stage's h_BSD elsewhere; carry_C the `CARRIED` scalars so far; the last stage returns
    the final-norm hidden states (its LM head runs in the loss, chunked or not). `ssl_mask_N`
    (loss.visual_ssl): stage 0 adds the vision encoder's masked-patch loss to carry_C."""

    def __init__(self, model: MultimodalModel, stage: int, n_stages: int, layers: range):
        super().__init__()
        if model.cfg.decoder.tie_embeddings and n_stages > 1:
            raise UserError("model.decoder.tie_embeddings: the embedding and the LM head sit on the first "
                            "and last pipeline stages; untie them to use dist.pp")
        self.cfg, self.stage, self.n_stages = model.cfg, stage, n_stages
        self.init_seed = model.init_seed  # materialize: the blocks' values are the whole model's
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        dec = model.decoder
        self.vision = model.vision if self.is_first else None
        # loss.visual_next's head reads the final hidden states: on the last stage, beside the LM head
        self.visual_head = model.visual_head if self.is_last else None
        self.encode_media = None
        kept = nn.ModuleDict({str(i): dec.layers[i] for i in layers})  # names as in the full model
        dec.layers = kept
        if not self.is_first:
            dec.embed = None
        if not self.is_last:
            dec.norm, dec.lm_head = None, None
        self.decoder = dec
        self.layer_ids = list(layers)
        self.context: ContextShard | None = None  # dist.tp > 1: this rank's chunk of every row
        self.records: list[dict] = []  # per micro-batch forward: {layer: (load_3E, entropy_3)}
        self.measure_attn = False  # a log step (set by loop/pipeline_step.py): count what attention visits
        self.attn_records: list[dict] = []  # per micro-batch forward: {layer: attention/counts.py's counts}

    def visual_next_pred(self, hidden_BSD: Tensor, modality_BS: Tensor, grid_thw_M3: Tensor) -> Tensor:
        """The last stage's visual head on its hidden states (MultimodalModel.visual_next_pred, this
        stage's row shard under tp / cp)."""
        return MultimodalModel.visual_next_pred(self, hidden_BSD, modality_BS, grid_thw_M3, self.context)

    def moe_layers(self) -> dict[int, MoE]:
        return self.decoder.moe_layers()  # this stage's layers, by the full model's indices

    def update_moe_bias(self, reduce_fn: Callable[[Tensor], None] | None = None) -> None:
        """This stage's MoE layers' bias step (each layer lives on one stage: no pp exchange needed)."""
        MultimodalModel.update_moe_bias(self, reduce_fn)

    def forward(self, x: Tensor, carry_C: Tensor | None = None, *, tokens_BS: Tensor, pos_ids_3BS: Tensor,
                doc_ids_BS: Tensor, span_ids_BS: Tensor, modality_BS: Tensor, patches_NP: Tensor,
                grid_thw_M3: Tensor, ssl_mask_N: Tensor | None = None) -> tuple[Tensor, Tensor]:
        dec, shard = self.decoder, self.context
        meta = build_meta(doc_ids_BS, span_ids_BS, dec.cfg.attention.block_size)  # rebuilt per stage
        visual_ND = None
        if self.is_first:
            encode = self.encode_media if self.training and self.encode_media is not None else None
            visual_ND = (self.vision(patches_NP, grid_thw_M3) if encode is None
                         else encode(self.vision, patches_NP, grid_thw_M3, modality_BS))
        if shard is not None:  # meta stays the whole rows'; x past stage 0 is the chunk already
            tokens, modality_BS, pos_ids_3BS, visual_ND = dec.shard_inputs(
                shard, x if self.is_first else None, modality_BS, pos_ids_3BS, visual_ND)
            x = tokens if self.is_first else x
        if self.is_first:
            h_BSD = dec.embed_tokens(x, modality_BS, visual_ND)
            ssl = (h_BSD.new_zeros((), dtype=torch.float32) if ssl_mask_N is None  # MultimodalModel's
                   else self.vision.masked_patch_loss(patches_NP, grid_thw_M3, ssl_mask_N).float())
            carry_C = torch.cat([h_BSD.new_zeros(len(AUX_NAMES), dtype=torch.float32), ssl[None]])
        else:
            h_BSD = x
        stats = {i: {} for i in self.layer_ids} if self.measure_attn else {}
        # Decoder.forward's own layer loop over this stage's layers (the one forward, models/decoder.py)
        h_BSD, aux, load, entropy = dec.run_layers(h_BSD, pos_ids_3BS, meta, modality_BS, shard, {}, stats)
        if aux:
            n = len(AUX_NAMES)
            carry_C = torch.cat([carry_C[:n] + torch.stack([aux[k].float() for k in AUX_NAMES]), carry_C[n:]])
        self.records.append({i: (load[i].detach(), entropy[i].detach()) for i in load})
        if stats:
            self.attn_records.append(stats)
        if self.is_last:
            h_BSD = dec.norm(h_BSD)
        return h_BSD, carry_C


def stage_ranges(model: MultimodalModel, schedule: str, pp: int, seq_len: int, vision_stage: bool = False,
                 costs: dict | None = None) -> list[range]:
    """Every stage's decoder layers, split by `costs` (default `stage_costs`; dist.pp_split: measured
    passes times) with dist.pp_vision_stage's `vision_stage`. `model` may be on the meta device."""
    n_stages = pp * stages_per_rank(schedule)
    return split_layers(costs or stage_costs(model, seq_len), n_stages, vision_stage)


def build_stage_models(model: MultimodalModel, schedule: str, pp_rank: int, pp: int, seq_len: int,
                       vision_stage: bool = False, costs: dict | None = None,
                       ranges: list[range] | None = None) -> list[StageModel]:
    """This rank's stages, each a pruned deep copy of `model` (`stage_ranges` unless `ranges` given).
    On the meta device (PipelineModel's way) the copies cost nothing; `materialize` then gives each
    stage its values. Split first, then checkpoint / compile each stage's blocks (torchtitan's
    order): an activation-checkpointed block's forward is an instance attribute closing over the
    block, which a deep copy would share."""
    wrapped = [m for m in model.modules() if "forward" in vars(m)]
    if wrapped:
        raise ValueError("build_stage_models: split the plain model, then apply activation checkpointing "
                         "(dist.activation_checkpointing) to each stage's blocks")
    ranges = ranges or stage_ranges(model, schedule, pp, seq_len, vision_stage, costs)
    ids = stage_ids(schedule, pp_rank, pp)
    return [StageModel(copy.deepcopy(model) if len(ids) > 1 else model, s, len(ranges), ranges[s])
            for s in ids]


def materialize(part: StageModel, device: torch.device) -> StageModel:
    """A stage split from a meta-device model given the values one process gives those blocks
    (`seeded_init`: each block from its own seed), built on the host and moved to `device`: the
    rank never holds more than its stage."""
    if any(p.is_meta for p in part.parameters()):
        part.to_empty(device="cpu")
        seeded_init(part, part.init_seed)
    return part.to(device)


def stage_rank(schedule: str, stage: int, pp: int) -> int:
    """The pp rank running `stage` (the inverse of `stage_ids`)."""
    if schedule in V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def block_stage(name: str, ranges: list[range]) -> int:
    """The stage holding a block (pipeline_replica.block_modules' names)."""
    if name in ("vision", "decoder.embed"):
        return 0
    if name.startswith("decoder.layers."):
        i = int(name.rsplit(".", 1)[1])
        return next(s for s, r in enumerate(ranges) if i in r)
    return len(ranges) - 1  # the final norm, the LM head and the visual head


def checkpoint_stages(parts: list[StageModel], device: torch.device) -> None:
    """Activation checkpointing per stage (dist.activation_checkpointing): each vision block and
    decoder layer the stage holds recomputes in backward, as parallelize.py does for one model
    (the grouped_mm probe first: run inside a checkpointed block it breaks the recompute)."""
    prime_probes(device)
    for part in parts:
        blocks = [*(part.vision.blocks if part.vision is not None else []),
                  *(part.decoder.layers[str(i)] for i in part.layer_ids)]
        for block in blocks:
            checkpoint_forward(block)


def compile_stages(parts: list[StageModel], backend: str) -> None:
    """dist.compile: torch.compile each vision block and decoder layer a stage holds, as
    parallelize.compile_blocks does for one model (after checkpointing, before tp and FSDP)."""
    if not parts:
        return
    dec = parts[0].decoder.cfg
    kinds = len(set(dec.layer_kinds()))
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, layer_graphs(kinds))
    for part in parts:
        if part.vision is not None:
            blocks = part.vision.blocks
            for j, block in enumerate(blocks):
                blocks[j] = torch.compile(block, backend=backend)
        for i in part.layer_ids:
            part.decoder.layers[str(i)] = torch.compile(part.decoder.layers[str(i)], backend=backend)


def build_schedule(name: str, parts: list[StageModel], pp_group, device: torch.device, n_microbatches: int,
                   loss_fn: Callable, example: dict[str, Tensor], dtype: torch.dtype = torch.float32):
    """torch's schedule over this rank's stages. Shapes are given up front (static mode: no
    metadata-inference forward, so nothing runs twice): h_BSD (in `dtype`, the stages' compute
    dtype) and carry_C (fp32) between stages, tokens into stage 0. Gradients are not rescaled by the
    schedule: `loss_fn` returns the share to backward."""
    cls = schedule_class(name)
    n_stages = parts[0].n_stages
    B, S = example["tokens_BS"].shape
    shard = parts[0].context
    S = S if shard is None else shard.hi - shard.lo  # sequence parallelism: the chunk crosses
    D = parts[0].cfg.decoder.dim
    acts = boundary_args(B, S, D, dtype, device)
    stages = [PipelineStage(part, part.stage, n_stages, device, group=pp_group, output_args=acts,
                            input_args=(example["tokens_BS"],) if part.is_first else acts)
              for part in parts]
    try:
        if issubclass(cls, PipelineScheduleSingle):
            return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    except ValueError as e:  # torch's own constraint on the micro-batch count, in one line
        raise UserError(f"train.grad_accum: {n_microbatches} micro-batches do not fit dist.pp_schedule "
                        f"{name}: {str(e).splitlines()[0]}") from None


def boundary_args(B: int, S: int, D: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """What a stage sends and receives, as torch's static stage metadata: (h_BSD in `dtype`, carry_C
    fp32), both carrying gradients (carry_C without MoE layers or visual_ssl before it has none to
    give: torch skips it)."""
    return (torch.empty(B, S, D, device=device, dtype=dtype, requires_grad=True),
            torch.empty(len(CARRIED), device=device, dtype=torch.float32, requires_grad=True))


def run_schedule(schedule, arg_mbs: list, kwarg_mbs: list, target_mbs: list,
                 forward_only: bool = False) -> None:
    """`schedule.step` on micro-batches the caller made: ours are the loader's micro-batches, whose
    media (patches, grids) differ in length, so they cannot come from splitting one batch.
    `forward_only`: as `schedule.eval` (the loss_fn still runs on the last stage, nothing backwards)."""
    stages = schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]
    has_backward = schedule._has_backward
    schedule._has_backward = has_backward and not forward_only
    try:
        for stage in stages:  # what step() does before its split
            stage.has_backward = schedule._has_backward
            stage.clear_runtime_states()
        with pipeline_p2p.named(stages[0].group):  # gloo: the sends and receives bounded and named
            schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, None, return_outputs=False)
    finally:
        schedule._has_backward = has_backward


def pp_grad_norm_of(grads: list[Tensor], group, device: torch.device) -> Tensor:
    """The norm of `grads` over the pipeline group: a stage without any of them adds 0, on `device`
    (a CPU tensor on an NCCL group raises: the first log step of a pipeline on GPUs)."""
    sq = global_norm(grads, device).double().square()
    dist.all_reduce(sq, group=group)
    return sq.sqrt().float()


def pp_grad_norm(parts: list[nn.Module], pp_group, max_norm: float) -> Tensor:
    """The gradient norm over every stage (squares summed over the pipeline group), gradients
    clipped to `max_norm` (0: no clip); the same 0-dim tensor on every rank of the pipeline."""
    grads = [p.grad for m in parts for p in m.parameters() if p.grad is not None]
    device = next(p.device for m in parts for p in m.parameters())  # a stage holds parameters
    norm = pp_grad_norm_of(grads, pp_group, device)
    if max_norm:  # per mesh: DTensors on different meshes (dense, experts) cannot meet in one op
        params = [p for m in parts for p in m.parameters() if p.grad is not None]
        for group in _by_mesh(params, lambda p: p.grad).values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm
