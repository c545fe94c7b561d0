"""The pipeline split from measured cost (`dist.pp_split: measured`): time, don't count.

    costs = measured_costs(timing_model(skeleton, device), cfg, device)   # seconds: {"vision",
                                                                           #   "layers": [...], "head"}
    ranges = split_layers(costs, n_stages, ...)    # the same dynamic programme as the FLOP model's

`stage_costs` (mmtrain/parallel/pipeline.py) is a FLOP model: it misses what FLOPs do not say (the
encoder's attention kernels at small dims, the sparse layers' gathers, the MoE dispatch, memory-bound
norms). Here one forward + backward of each part runs on this rank's device at the config's shapes
before the split: `data.batch_size` rows of `data.seq_len` tokens (one document a row) through one
decoder layer of each kind (MoE or dense FFN x sparse or full attention: identical layers cost the
same), the final norm + LM head + cross-entropy, and the vision encoder + projector on the media that
fill the rows' visual share (`visual_fraction`, as `stage_costs`: images of `patches_per_medium`
patches), under the step's autocast (bf16 on CUDA when `train.dtype` is bfloat16, as the trainer's).
The head runs a chunk of tokens at a time (the trainer's loss never holds all (B, S, V) logits
either). The fastest of `iters` timed runs (after one warm-up) is taken: the least disturbed.

Every rank must cut the same way (a stage's data ranks shard the same layers; the pipeline's ranks
hand each other the same boundaries), so the times are all-reduced with MAX over the world before
the split: every rank reads the slowest rank's times. The inputs come from a private generator, the
runs go under a forked RNG (the global RNG state is as before) and the timed gradients are dropped,
so the run after is the run that would have started without the timing. Not timed: activation
checkpointing's recompute and tensor parallelism's split (both applied after the cut, both scaling
every block alike).

Legend: B rows, S tokens, D decoder width, V vocabulary, N patches, P patch values, M media.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from mmtrain.models.attention import build_meta
from mmtrain.models.multimodal import seeded_init
from mmtrain.parallel.pipeline import AUX_NAMES

Tensor = torch.Tensor
Timer = Callable[[object, Callable[[], None]], float]  # (key, run once) -> seconds a run
HEAD_CHUNK = 4096  # tokens of logits at once in the head's run


def measured_costs(model, cfg, device: torch.device, timer: Timer | None = None,
                   visual_fraction: float = 0.25, patches_per_medium: int = 256) -> dict:
    """{"vision": s, "layers": [s per decoder layer], "head": s}: one forward + backward of each part,
    the max over every rank (module docstring). timer(key, fn): key is "vision", "head" or
    ("layer", i) for the first layer i of its kind; the default runs fn and times it (`wall_timer`)."""
    timer = timer or wall_timer(device)
    dec = model.cfg.decoder
    g = torch.Generator(device="cpu").manual_seed(0)
    B, S = cfg.data.batch_size, cfg.data.seq_len
    kinds = dec.layer_kinds()
    first = first_of_kind(kinds)  # kind -> its first layer
    rows = _rows(B, S, device, g)
    bf16 = device.type == "cuda" and cfg.train.dtype == "bfloat16"
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()  # the trainer's
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), amp:  # RNG untouched
        vision = _vision_run(model, rows, visual_fraction, patches_per_medium, device, g)
        times = {"vision": timer("vision", vision), "head": timer("head", _head_run(model, rows, device, g))}
        for kind, i in first.items():
            times[kind] = timer(("layer", i), _layer_run(model, i, rows, device, g))
    for p in model.parameters():  # the timed runs' gradients are not the step's
        p.grad = None
    keys = ["vision", "head", *first]
    t = torch.tensor([float(times[k]) for k in keys], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # every rank the slowest rank's times: one cut
    got = dict(zip(keys, t.tolist()))
    return {"vision": got["vision"], "layers": [got[k] for k in kinds], "head": got["head"]}


def first_of_kind(kinds: list[tuple[bool, bool]]) -> dict[tuple[bool, bool], int]:
    """(MoE, sparse) of each layer -> the first layer of each kind: the layers `measured_costs` times."""
    return {k: kinds.index(k) for k in dict.fromkeys(kinds)}


def timing_model(skeleton, device: torch.device):
    """A copy of a meta-device model with only what `measured_costs` runs given values on `device`:
    the vision encoder, the final norm, the LM head (or the tied embedding) and the first decoder
    layer of each kind. The others stay on meta: a rank never holds the whole model to time it."""
    model = copy.deepcopy(skeleton)
    dec = model.decoder
    timed = [model.vision, dec.norm, dec.lm_head if dec.lm_head is not None else dec.embed,
             *(dec.layers[i] for i in first_of_kind(dec.cfg.layer_kinds()).values())]
    for module in timed:
        module.to_empty(device=device)
    seeded_init(model, model.init_seed)  # the meta blocks: no values drawn
    return model


def wall_timer(device: torch.device, iters: int = 3) -> Timer:
    """Seconds of the fastest of `iters` runs of fn, after one warm-up (allocator, kernels, lazy init)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(key, fn) -> float:
        fn()
        best = float("inf")
        for _ in range(iters):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    return timed


def _rows(B: int, S: int, device: torch.device, g: torch.Generator) -> dict:
    """B text rows of S tokens, one document a row (its attention the costliest packing of S)."""
    pos_S = torch.arange(S)
    return {"doc_ids_BS": torch.zeros(B, S, dtype=torch.long, device=device),
            "span_ids_BS": torch.full((B, S), -1, dtype=torch.long, device=device),
            "modality_BS": torch.zeros(B, S, dtype=torch.long, device=device),
            "pos_ids_3BS": pos_S.expand(3, B, S).contiguous().to(device)}


def _layer_run(model, i: int, rows: dict, device: torch.device, g: torch.Generator) -> Callable[[], None]:
    dec = model.decoder
    layer = dec.layers[i]
    B, S = rows["doc_ids_BS"].shape
    meta = build_meta(rows["doc_ids_BS"], rows["span_ids_BS"], dec.cfg.attention.block_size)
    h_BSD = torch.randn(B, S, dec.cfg.dim, generator=g).to(device).requires_grad_()
    w_BSD = torch.randn(B, S, dec.cfg.dim, generator=g).to(device)

    def run() -> None:
        cos_B1SF, sin_B1SF = dec.rotary(rows["pos_ids_3BS"])
        out_BSD, aux, _ = layer(h_BSD, cos_B1SF, sin_B1SF, meta, dec.cfg.attention, rows["modality_BS"],
                                False, None)
        loss = (out_BSD * w_BSD).sum()
        if aux:  # the MoE auxiliary losses' backward too, as the pipeline carries them
            loss = loss + sum(aux[n].float() for n in AUX_NAMES)
        loss.backward()

    return run


def _head_run(model, rows: dict, device: torch.device, g: torch.Generator) -> Callable[[], None]:
    dec = model.decoder
    B, S = rows["doc_ids_BS"].shape
    h_TD = torch.randn(B * S, dec.cfg.dim, generator=g).to(device).requires_grad_()
    labels_T = torch.randint(0, dec.cfg.vocab_size, (B * S,), generator=g).to(device)

    def run() -> None:
        for lo in range(0, B * S, HEAD_CHUNK):  # logits (chunk, V) at a time; each chunk's backward
            hi = min(lo + HEAD_CHUNK, B * S)
            logits_CV = dec.logits(dec.norm(h_TD[lo:hi])).float()
            torch.nn.functional.cross_entropy(logits_CV, labels_T[lo:hi], reduction="sum").backward()

    return run


def _vision_run(model, rows: dict, visual_fraction: float, patches_per_medium: int, device: torch.device,
                g: torch.Generator) -> Callable[[], None]:
    """The encoder + projector on square images of about `patches_per_medium` patches, as many as
    fill `visual_fraction` of the rows' tokens (at least one)."""
    vis = model.cfg.vision
    m = vis.merge
    side = max(m, round(patches_per_medium ** 0.5) // m * m)  # h = w, a multiple of merge
    B, S = rows["doc_ids_BS"].shape
    M = max(1, round(visual_fraction * B * S / (side * side // (m * m))))
    grid_thw_M3 = torch.tensor([[1, side, side]] * M, device=device)
    patches_NP = torch.randn(M * side * side, vis.patch_dim, generator=g).to(device)
    w = torch.randn(M * side * side // (m * m), model.cfg.decoder.dim, generator=g).to(device)

    def run() -> None:
        (model.vision(patches_NP, grid_thw_M3) * w).sum().backward()

    return run
