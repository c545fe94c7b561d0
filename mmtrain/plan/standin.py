"""What `mmtrain plan` traces in place of the pieces that cannot run on fake tensors.

Attention: the real backends read host values (flex's BlockMask, gather's block lists, the sdpa
segment plan), so a fake forward cannot run them. The `plan` backend stands in for every layer
kind with aten's flash-style kernel (causal over the whole row: the same O(S) memory as flex and
flash on the GPU: the output and one fp32 log-sum-exp per query and head saved for backward, K/V
expanded to the query heads as views). Its FLOPs are counted by hand (mmtrain/plan/flops.py), never
traced. Selection (sparse layers' block scores and top-k picks) still runs for real.

Legend: B rows, H query heads, K kv heads, S tokens, D head dim.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from mmtrain.models.attention.registry import (
    ANY,
    BACKENDS,
    BOTH,
    Backend,
    register_backend,
    unregister_backend,
)

Tensor = torch.Tensor
NAME = "plan"


def attend_standin(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta, cfg, sel) -> Tensor:
    B, H, S, D = q_BHSD.shape
    rep = H // k_BKSD.shape[1]
    k_BHSD = k_BKSD[:, :, None].expand(-1, -1, rep, -1, -1).reshape(B, H, S, D)
    v_BHSD = v_BKSD[:, :, None].expand(-1, -1, rep, -1, -1).reshape(B, H, S, D)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return flash(q_BHSD, k_BHSD, v_BHSD, is_causal=True)[0]


@contextlib.contextmanager
def standin_backend():
    """The stand-in registered as backend "plan" while a plan runs, and only then: it is not the
    rule's function, so nothing else (a config, a test iterating over the backends) may pick it."""
    mine = NAME not in BACKENDS
    if mine:
        register_backend(Backend(NAME, attend_standin, layers=BOTH, devices=ANY, train=ANY))
    try:
        yield
    finally:
        if mine:
            unregister_backend(NAME)


def attend_context_standin(q_BHsD: Tensor, k_BKsD: Tensor, v_BKsD: Tensor, meta, cfg, sparse: bool,
                           shard) -> Tensor:
    """Context parallelism: every layer all-gathers K/V over cp (the real collective: full layers'
    traffic and memory; for sparse layers the selective fetch's upper bound, which it reaches with
    random picks up to cp = 8, and its buffer, which is the whole row's), then the flash-style
    kernel for the rank's queries over the row."""
    k_BKSD, v_BKSD = shard.comm.gather_seq(k_BKsD), shard.comm.gather_seq(v_BKsD)
    B, H, s, D = q_BHsD.shape
    rep, S = H // k_BKSD.shape[1], k_BKSD.shape[2]
    k_BHSD = k_BKSD[:, :, None].expand(-1, -1, rep, -1, -1).reshape(B, H, S, D)
    v_BHSD = v_BKSD[:, :, None].expand(-1, -1, rep, -1, -1).reshape(B, H, S, D)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q_BHsD, k_BHSD, v_BHSD)[0]


@contextlib.contextmanager
def context_standin():
    """attend()'s context-parallel path -> attend_context_standin, for the duration."""
    from mmtrain.models.attention import api

    real = api.attend_context
    api.attend_context = attend_context_standin
    try:
        yield
    finally:
        api.attend_context = real


class PlanDispatcher:
    """Expert parallelism with stated split sizes: the real dispatcher reads the routed row counts
    on the host, which fake tensors do not have. Every rank sends its T*K rows evenly over the ep
    ranks; this rank receives `imbalance` times its share (1.0: uniform routing; the most loaded
    rank of a real step gets more). The exchanges, the local experts' grouped GEMM and the combine
    are the real ones (mmtrain/parallel/comm.py, models/moe/dispatch.py)."""

    def __init__(self, real, imbalance: float) -> None:
        self.group, self.P, self.me, self.E, self.L = real.group, real.P, real.me, real.E, real.L
        self.count, self.imbalance = real._count, imbalance

    def chunks(self, T: int, chunk: int, device: torch.device) -> int:
        """The planned batch is the same on every rank: no agreement to make (the real dispatcher's
        one-int all-reduce is left out of the traffic)."""
        from mmtrain.models.moe.dispatch import chunk_count

        return chunk_count(T, chunk)

    def __call__(self, experts, x_TD: Tensor, idx_TK: Tensor, w_TK: Tensor) -> Tensor:
        from mmtrain.models.moe.dispatch import combine, sort_by_expert
        from mmtrain.parallel.comm import AllToAll

        rows = sort_by_expert(idx_TK, self.E)
        n = rows.token_R.shape[0]
        send_P = _even(n, self.P)
        recv_P = _even(round(n * self.imbalance), self.P)
        x_nD = x_TD.index_select(0, rows.token_R)
        x_recv = AllToAll.apply(x_nD, recv_P, send_P, self.group, self.count)
        counts_L = torch.tensor(_even(sum(recv_P), self.L), device=x_TD.device)
        y_recv = experts(x_recv, counts_L)
        y_RD = AllToAll.apply(y_recv, send_P, recv_P, self.group, self.count)
        return combine(y_RD, rows, w_TK, x_TD)


def _even(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


def plan_dispatchers(model, imbalance: float) -> None:
    """Replace each MoE layer's all-to-all dispatcher (if EP installed one) by the planning one."""
    from mmtrain.parallel.expert_parallel import AllToAllDispatcher

    for moe in model.moe_layers().values():
        if isinstance(moe.dispatcher, AllToAllDispatcher):
            moe.dispatcher = PlanDispatcher(moe.dispatcher, imbalance)


class PlanMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Outside fake mode (the batch's integer fields stay real, for the host reads the model makes
    on them), three things a fake step needs:
    - a floating-point tensor made from nothing (FSDP2's all-gather buffers, activations'
      `torch.zeros`) is fake: never real memory; integer ones (positions, masks) stay real;
    - a fake tensor read on the host (`float(loss)`, `.item()`, the gradient norm) gives a stated
      value instead of raising: the control flow of a finite step;
    - fp32 `_grouped_mm` (CPU has it; its fake kernel checks for bf16) gets its shape from a bf16 call.
    """

    def __init__(self, fake) -> None:
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        other_fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
        if not other_fake and _is_constructor(func) and _made_dtype(func, args, kwargs).is_floating_point:
            with self.fake:
                return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default and _is_fake(args[0]):
            return True if args[0].dtype == torch.bool else (1 if not args[0].is_floating_point() else 1.0)
        if func in _INDEXING and _is_fake(args[0]) and any(_real_mask(t) for t in args[1]):
            return func(args[0], _as_positions(args[1]), *args[2:], **kwargs)
        grouped = func is torch.ops.aten._grouped_mm.default
        if grouped and _is_fake(args[0]) and args[0].dtype == torch.float32:
            a, b = (t.to(torch.bfloat16) for t in args[:2])
            return func(a, b, *args[2:], **kwargs).to(torch.float32)
        return func(*args, **kwargs)


_INDEXING = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
             torch.ops.aten._index_put_impl_.default)


def _real_mask(t) -> bool:
    return isinstance(t, Tensor) and not _is_fake(t) and t.dtype == torch.bool


def _as_positions(indices: list) -> list:
    """A fake tensor indexed by a real boolean mask (`x[mask]`, and its backward): the mask's
    positions, read on the host, in its place (a fake mask's count would be unknown)."""
    out = []
    for t in indices:
        out.extend(t.nonzero(as_tuple=True) if _real_mask(t) else [t])
    return out


def _made_dtype(func, args, kwargs) -> torch.dtype:
    """The dtype a constructor makes: its own, else arange / full infer it from their numbers."""
    if kwargs.get("dtype") is not None:
        return kwargs["dtype"]
    if func.__name__.startswith(("arange", "full", "scalar_tensor")):
        numbers = [a for a in args if isinstance(a, (int, float, bool))]
        return torch.get_default_dtype() if any(isinstance(a, float) for a in numbers) else torch.int64
    return torch.get_default_dtype()


def _is_constructor(func) -> bool:
    from torch._subclasses.fake_tensor import _is_tensor_constructor

    return _is_tensor_constructor(func)


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def plan_vision_balance(model, cfg, dims) -> None:
    """`vision.balance` other than none: the trainer's balancer (mmtrain/parallel/vision_balance.py:
    its assignment, exchanges and encoder), except that the grids every rank would gather are
    this rank's own (the planned batch is the same on every rank; the fake group's all-gather
    returns nothing)."""
    from mmtrain.parallel.vision_balance import VisionBalancer, balance_group

    class PlanVisionBalancer(VisionBalancer):
        encoded: list[int] = []  # patches of each medium this rank encodes (flops.py reads them)

        def _gather_grids(self, grid_M4: Tensor):
            n = grid_M4.new_tensor([grid_M4.shape[0]])  # the real collectives, for their traffic
            dist.all_gather([torch.empty_like(n) for _ in range(self.G)], n, group=self.group)
            dist.all_gather([torch.empty_like(grid_M4) for _ in range(self.G)], grid_M4, group=self.group)
            rows = grid_M4.tolist()
            units = self.G // self.unit
            return [[g[:3] for g in rows]] * units, [[g[3] for g in rows]] * units

        def _note(self, sizes_U, owner_U) -> None:
            super()._note(sizes_U, owner_U)
            self.encoded = [n for sizes, owners in zip(sizes_U, owner_U)
                            for n, o in zip(sizes, owners) if o == self.me]

    group, unit = balance_group(cfg.vision.balance, dims)
    if group is not None:  # a group of its own (the same ranks): its traffic reported as "vision"
        v = cfg.vision
        own = dist.new_group(dist.get_process_group_ranks(group))
        model.encode_media = PlanVisionBalancer(own, unit, (v.cost_a, v.cost_b, v.cost_c))


def vision_group(model):
    """The plan's vision balance group (None without balancing)."""
    return getattr(model.encode_media, "group", None)
