"""The evaluation model at dist.pp > 1: one replica a pipeline, in host memory, streamed to the device.

Evaluation, diagnostics and captioning need whole forwards (and captioning a KV cache), which the
stages do not run. So the first-stage rank of each pipeline (pp rank 0) holds a replica of the
whole model in host memory, loaded block by block from the stages (`refresh`), and runs those
passes on it; the other ranks of the pipeline hold only its meta-device skeleton and add nothing
(the passes' sums are all-reduced over the world, so each data rank counts once).

    replica = PipelineReplica(cfg.model, seed, holder=dims.pp_rank == 0, device=device)
    replica.refresh(parts, owner, pp_group)   # every rank of the pipeline, at the same points
    replica.model                             # holder: the replica (forward it on `device`);
                                              # others: the skeleton (never forwarded)

Memory, bounded: a pipeline's holder keeps the whole model's parameters in host memory (fp32, 4
bytes a parameter: 24 GB at 6B, pinned on CUDA), and on its device at most one module's own
weights beyond its stage (`Streamed`: each module's parameters move in for its forward and out
after it, as accelerate's CPU offload does). A refresh moves one block at a time: the owning stage
gathers that block's FSDP shards, sends them to the holder, which copies them to host memory.
No rank ever holds a second copy of its stage or the whole model on its device.

Streaming moves every weight host -> device once a forward: at 6B, 24 GB over PCIe (~25 GB/s) is
about a second a forward. Evaluation batches are few; it is the price of not keeping the replica
on the device. Outside a forward the replica's parameters are meta tensors, so a code path that
reads a weight without calling its module fails loudly, on the CPU too (the PP tests evaluate,
diagnose and caption through it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mmtrain.errors import UserError
from mmtrain.models.multimodal import MultimodalModel, seeded_init

Tensor = torch.Tensor


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib * 1024


def block_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The blocks a model or pipeline stage holds, by the names both share: `vision`,
    `decoder.embed`, `decoder.layers.<i>`, `decoder.norm`, `decoder.lm_head`, `visual_head`."""
    dec = model.decoder
    out = {"vision": model.vision, "decoder.embed": dec.embed}
    out |= {f"decoder.layers.{i}": layer for i, layer in dec.numbered_layers()}
    out |= {"decoder.norm": dec.norm, "decoder.lm_head": dec.lm_head, "visual_head": model.visual_head}
    return {k: m for k, m in out.items() if m is not None}


def block_state(block: nn.Module) -> dict[str, Tensor]:
    """The block's state (FSDP / tp shards gathered: a collective over their meshes), names sorted and
    without dist.compile's `_orig_mod.`."""
    state = {k.replace("_orig_mod.", ""): v for k, v in block.state_dict().items()}
    return {k: (state[k].full_tensor() if isinstance(state[k], DTensor) else state[k]) for k in sorted(state)}


class Streamed:
    """`model`'s parameters and buffers kept in host memory (`host`, filled by `capture`); each
    module's own ones (not its children's) are placed on `device` by a forward pre-hook and taken off
    by the forward hook. Off the device a parameter is a meta tensor of its shape; after `release` a
    forward raises (KeyError: the module has no host values)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.host: dict[nn.Module, dict[str, Tensor]] = {}
        for mod in model.modules():
            if _own(mod):
                mod.register_forward_pre_hook(lambda m, args: self._on(m))
                mod.register_forward_hook(lambda m, args, out: self._off(m))

    def capture(self) -> None:
        """The model's current tensors become the host values (pinned on CUDA); the modules keep
        meta tensors of their shapes."""
        pin = self.device.type == "cuda"
        for mod in self.model.modules():
            own = _own(mod)
            if own:
                self.host[mod] = {n: (t.detach().pin_memory() if pin else t.detach()) for n, t in own.items()}
                self._off(mod)

    def release(self) -> None:
        """Drop the host values (the modules hold only meta tensors already)."""
        self.host.clear()

    def _on(self, mod: nn.Module) -> None:
        for n, t in self.host[mod].items():
            self._place(mod, n, t.to(self.device, non_blocking=True))

    def _off(self, mod: nn.Module) -> None:
        for n, t in self.host[mod].items():
            self._place(mod, n, torch.empty_like(t, device="meta"))

    @staticmethod
    def _place(mod: nn.Module, name: str, t: Tensor) -> None:
        if name in mod._parameters:
            mod._parameters[name] = nn.Parameter(t, requires_grad=False)
        else:
            mod._buffers[name] = t

    def tensor(self, name: str) -> Tensor:
        """The host tensor of the model's parameter or buffer `name` (a state-dict key)."""
        path, _, leaf = name.rpartition(".")
        return self.host[self.model.get_submodule(path)][leaf]

    def nbytes(self) -> int:
        return sum(t.nbytes for own in self.host.values() for t in own.values())


def _own(mod: nn.Module) -> dict[str, Tensor]:
    """A module's own parameters and buffers (not its children's)."""
    return {n: t for n, t in [*mod._parameters.items(), *mod._buffers.items()] if t is not None}


class PipelineReplica:
    """See the module docstring. The holder's host memory is taken at the first `refresh` after a
    `release` (the trainer releases it at the optimizer step after an evaluation point), so a run
    holds it only around evaluation, diagnostics and captioning."""

    def __init__(self, cfg_model, seed: int, holder: bool, device: torch.device):
        self.holder, self.device, self.seed = holder, device, seed
        with torch.device("meta"):
            self.model = MultimodalModel(cfg_model, init_seed=seed)
        self.streamed = Streamed(self.model, device) if holder else None

    def release(self) -> None:
        if self.streamed is not None:
            self.streamed.release()

    def _build(self) -> None:
        """Host memory for the whole model, with the values one process starts from (the non-persistent
        buffers, which no stage sends, included); refused in one line when the host lacks it."""
        need = sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])
        have = available_host_bytes()
        if have is not None and need > have:
            raise UserError(f"dist.pp: evaluation runs on a replica of the whole model in host memory "
                            f"({need / 2**30:.1f} GiB) and this host has {have / 2**30:.1f} GiB available; "
                            f"set train.eval_every: 0, diagnostics.every: 0 and captions.images / videos: 0 "
                            f"and evaluate the checkpoints offline")
        self.model.to_empty(device="cpu")
        seeded_init(self.model, self.seed)
        self.streamed.capture()

    def refresh(self, parts: list[nn.Module], owner: Callable[[str], int], group) -> None:
        """The holder's replica loaded with the stages' weights, block by block in one order on every
        rank: the owning stage's ranks gather the block (`block_state`) and each sends it to its
        pipeline's holder (pp rank 0). `owner(block name)` -> the pp rank holding it. `group`: the
        pipeline's process group."""
        if self.holder and not self.streamed.host:
            self._build()
        mine = {name: m for part in parts for name, m in block_modules(part).items()}
        pp_rank = dist.get_rank(group)
        holder = dist.get_global_rank(group, 0)
        for name in block_modules(self.model):
            src = owner(name)
            if src == pp_rank:
                state = block_state(mine[name])
                for key, t in state.items():
                    if self.holder:
                        self.streamed.tensor(f"{name}.{key}").copy_(t)
                    else:
                        dist.send(t.detach().contiguous(), dst=holder, group=group)
            elif self.holder:
                for key in self._keys(name):
                    host = self.streamed.tensor(f"{name}.{key}")
                    buf = torch.empty(host.shape, dtype=host.dtype, device=self._comm_device(group))
                    dist.recv(buf, src=dist.get_global_rank(group, src), group=group)
                    host.copy_(buf)

    def host_state(self) -> dict[str, Tensor]:
        """The holder's replica values by state-dict name (host memory)."""
        return {k: self.streamed.tensor(k) for k in self.model.state_dict()}

    def _keys(self, name: str) -> list[str]:
        return sorted(self.model.get_submodule(name).state_dict())

    def _comm_device(self, group) -> torch.device:
        """Where point-to-point buffers live: the device on NCCL, the host on gloo."""
        return self.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
