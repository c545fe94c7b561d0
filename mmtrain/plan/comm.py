"""Collectives per step, by mesh dimension and kind, with the bytes each sends to other ranks.

A dispatch mode sees every c10d op the step issues (FSDP2's all-gathers and reduce-scatters, HSDP's
all-reduce, EP's all-to-alls, the loop's own all-reduces) with its process group; the group is
named by the mesh dimension it belongs to. Wire bytes per rank, as docs/DISTRIBUTED.md counts them
(ring / pairwise algorithms, n ranks in the group, N bytes the full tensor): all-gather and
reduce-scatter (n - 1) / n x N, all-reduce 2 (n - 1) / n x N, all-to-all the rows sent to other
ranks (a rank's own rows never leave it). The functional collectives DTensor's redistributions
issue (tensor parallelism's all-gathers and reduce-scatters, mmtrain/parallel/tensor_parallel.py)
are counted alike, by their group's name. Not seen: collectives DTensor issues inside its own
dispatch (the gradient norm's scalar all-reduces).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

FUNCTIONAL = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
              "all_reduce": "all_reduce"}  # torch.ops._c10d_functional -> kind
KINDS = {"allgather": "all_gather", "reduce_scatter": "reduce_scatter", "allreduce": "all_reduce",
         "alltoall": "all_to_all", "broadcast": "broadcast"}


def group_names(dims) -> dict[str, str]:
    """process group name -> the mesh dimensions it serves, e.g. 'fsdp', 'fsdp/ep' (one node of
    FSDP(8) + EP(8): the same 8 ranks); 'world' for a group that is nothing else."""
    dims_of: dict[str, set[str]] = {}
    for mesh in dims._meshes.values():
        for dim in mesh.mesh_dim_names or ():
            if mesh[dim].size() > 1:
                dims_of.setdefault(mesh.get_group(dim).group_name, set()).add(dim)
    order = lambda dim: (ROLES.index(dim) if dim in ROLES else len(ROLES), dim)  # noqa: E731
    return {g: "/".join(sorted(d - {"world", "dp_shard"}, key=order) or ["world"])
            for g, d in dims_of.items()}


# the names a group is reported by, in order (a dimension not listed sorts after them, by name)
ROLES = ("fsdp", "ep", "efsdp", "efsdp_tp", "dp_replicate", "cp", "tp", "seq", "dp_cp")


class CommCounter(TorchDispatchMode):
    """{(dimension, kind): [calls, wire bytes]} of the c10d ops issued while active."""

    def __init__(self, names: dict[str, str]) -> None:
        super().__init__()
        self.names = names
        self.calls: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self._count(func, args)
        elif func.namespace == "_c10d_functional" and func._opname in FUNCTIONAL:
            self._count_functional(FUNCTIONAL[func._opname], args)
        return func(*args, **(kwargs or {}))

    def _count_functional(self, kind: str, args) -> None:
        """A functional collective: (input, ..., group name); the input is one rank's piece for an
        all-gather, the full tensor for a reduce-scatter or an all-reduce."""
        from torch.distributed.distributed_c10d import _resolve_process_group

        name = args[-1]
        n = _resolve_process_group(name).size()
        nbytes = _nbytes(args[:1])
        wire = {"all_gather": nbytes * (n - 1), "reduce_scatter": nbytes * (n - 1) / n,
                "all_reduce": 2 * nbytes * (n - 1) / n}[kind]
        entry = self.calls[(self.names.get(name, f"group {name}"), kind)]
        entry[0] += 1
        entry[1] += wire

    def _count(self, func, args) -> None:
        kind = next((k for op, k in KINDS.items() if op in func._opname), None)
        flat, _ = tree_flatten(args)
        pg = next((_unbox(a) for a in flat if isinstance(a, torch.ScriptObject) and _unbox(a)), None)
        if kind is None or pg is None:
            return
        n = pg.size()
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        entry = self.calls[(self.names.get(pg.group_name, f"group {pg.group_name}"), kind)]
        entry[0] += 1
        entry[1] += _wire_bytes(func._opname, kind, tensors, args, n, pg.rank())


def _unbox(obj):
    """The ProcessGroup a c10d op's ScriptObject argument wraps (None: e.g. a ReduceOp)."""
    try:
        return dist.ProcessGroup.unbox(obj)
    except RuntimeError:
        return None


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _wire_bytes(op: str, kind: str, tensors, args, n: int, me: int) -> float:
    if n == 1:
        return 0.0
    if kind == "all_gather":  # the output is the full tensor
        # list form: n outputs per input, flattened ahead of the inputs
        out = tensors[0] if op.startswith("_allgather_base") else tensors[:len(tensors) // (n + 1) * n]
        return _nbytes([out] if isinstance(out, torch.Tensor) else out) * (n - 1) / n
    if kind == "reduce_scatter":  # the input is the full tensor
        inp = tensors[1:] if op.startswith("_reduce_scatter_base") else tensors[len(tensors) // (n + 1):]
        return _nbytes(inp) * (n - 1) / n
    if kind == "all_reduce":
        return 2 * _nbytes(tensors) * (n - 1) / n
    if kind == "all_to_all":
        inp, in_splits = tensors[1], list(args[4] or [])
        row = inp[:1].numel() * inp.element_size() if inp.dim() and inp.shape[0] else 0
        if not in_splits:
            return _nbytes([inp]) * (n - 1) / n
        return (sum(in_splits) - in_splits[me]) * row
    return _nbytes(tensors[:1]) * (n - 1)  # broadcast from the root: an upper bound


def crosses_nodes(dims, per_node: int) -> dict[str, bool]:
    """mesh dimension -> whether this rank's group of it spans several nodes of `per_node` GPUs."""
    out: dict[str, bool] = {}
    for mesh in dims._meshes.values():
        for dim in mesh.mesh_dim_names or ():
            ranks = mesh[dim].mesh.flatten().tolist()
            out.setdefault(dim, len({r // per_node for r in ranks}) > 1)
    return out
