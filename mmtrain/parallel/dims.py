"""The device mesh, built once from `dist.*`: who shards, who replicates, who holds which experts.

    world ranks, row-major:  dp_replicate x dp_shard x cp
    dense mesh:   (dp_replicate, fsdp = dp_shard * cp)    FSDP2 of every non-expert parameter
                                                          (HSDP when dp_replicate > 1)
    expert mesh:  (dp_replicate, efsdp, ep)               ep borrows ranks from dp_shard * cp
                                                          (torchtitan's way): routed experts are
                                                          Shard(0) over ep, FSDP2 over the rest
    data:         dp rank = rank // cp of dp_replicate * dp_shard; the ranks of a cp group read
                  the same rows

Both meshes are unflattened from one world mesh, so FSDP2 accepts an expert weight that is a
DTensor on `ep` under its own (dp_replicate, efsdp) mesh. One process: sizes 1, no mesh at all.
The trainer, the loader, the checkpoint and the evaluators all read this one object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmtrain.errors import UserError
from mmtrain.parallel.config import DistConfig


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    world_size: int
    rank: int = 0
    _meshes: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, cfg: DistConfig, world_size: int, rank: int = 0) -> ParallelDims:
        """Resolve `dp_shard: -1` (the rest of the world) and check that the sizes fit the world.
        One process has no mesh: the keys describe a launch, so `configs/base.yaml` also runs alone."""
        if world_size == 1:
            return cls(1, 1, 1, 1, 1, rank)
        if cfg.strategy == "ddp":
            if cfg.dp_shard not in (-1, 1) or cfg.cp != 1 or cfg.ep != 1:
                raise UserError("dist.strategy: ddp replicates the whole model; dist.dp_shard, dist.cp and "
                                f"dist.ep need fsdp (got {cfg.dp_shard}, {cfg.cp}, {cfg.ep})")
            if cfg.dp_replicate not in (1, world_size):
                raise UserError(f"dist.dp_replicate: ddp replicates over the whole world {world_size} "
                                f"(got {cfg.dp_replicate})")
            return cls(world_size, 1, 1, 1, world_size, rank)
        rest, dp_shard = cfg.dp_replicate * cfg.cp, cfg.dp_shard
        if dp_shard == -1:
            dp_shard = world_size // rest if world_size % rest == 0 else 0
        if cfg.dp_replicate * dp_shard * cfg.cp != world_size:
            raise UserError(f"dist.dp_replicate x dist.dp_shard x dist.cp must equal the world size "
                            f"{world_size} (got {cfg.dp_replicate} x {cfg.dp_shard} x {cfg.cp})")
        if (dp_shard * cfg.cp) % cfg.ep:
            raise UserError(f"dist.ep: must divide dist.dp_shard x dist.cp = {dp_shard * cfg.cp} "
                            f"(got {cfg.ep})")
        return cls(cfg.dp_replicate, dp_shard, cfg.cp, cfg.ep, world_size, rank)

    # ----- sizes and this rank's coordinates ---------------------------------------------------
    @property
    def dp_size(self) -> int:
        """Ranks that read different data (the global batch is dp_size x the per-rank batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def efsdp(self) -> int:
        return self.dp_shard * self.cp // self.ep

    @property
    def sharded(self) -> bool:
        return self.dp_shard * self.cp > 1

    def describe(self) -> str:
        return (f"mesh dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp} "
                f"ep={self.ep} (world {self.world_size})")

    # ----- meshes (built on first use: they need the process group) ------------------------------
    def dense_mesh(self, device_type: str):
        """(dp_replicate, fsdp): FSDP2's mesh for every parameter that is not a routed expert."""
        return self._mesh(device_type, "dense", (self.dp_replicate, self.dp_shard * self.cp),
                          ("dp_replicate", "fsdp"))

    def expert_mesh(self, device_type: str):
        """(dp_replicate, efsdp, ep): `ep` shards the experts, the other two are their FSDP2 mesh.
        (efsdp, ep) is also flattened, so an expert gradient's norm is one all-reduce, not two."""
        fresh = "expert" not in self._meshes
        mesh = self._mesh(device_type, "expert", (self.dp_replicate, self.efsdp, self.ep),
                          ("dp_replicate", "efsdp", "ep"))
        if fresh:
            mesh["efsdp", "ep"]._flatten("efsdp_ep")
        return mesh

    def cp_mesh(self, device_type: str):
        """(dp_replicate, dp_shard, cp): a `cp` group is the ranks that split the same rows."""
        return self._mesh(device_type, "cp", (self.dp_replicate, self.dp_shard, self.cp),
                          ("dp_replicate", "dp_shard", "cp"))

    def _mesh(self, device_type: str, name: str, sizes: tuple[int, ...], names: tuple[str, ...]):
        if name not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            if "world" not in self._meshes:
                self._meshes["world"] = init_device_mesh(device_type, (self.world_size,),
                                                         mesh_dim_names=("world",))
            self._meshes[name] = self._meshes["world"]._unflatten(0, sizes, names)
        return self._meshes[name]
