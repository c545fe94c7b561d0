"""The device mesh, built once from `dist.*`: who shards, who replicates, who holds which experts.

    world ranks, row-major:  pp x dp_replicate x dp_shard x cp x tp   (torchtitan's order: tp
                             innermost, so a tp group is neighbouring ranks, one node's fast links)
    dense mesh:   (dp_replicate, fsdp = dp_shard * cp * tp)  FSDP2 of every parameter that is not
                                                          a routed expert or tp-split (HSDP when
                                                          dp_replicate > 1)
    layer mesh:   (dp_replicate, fsdp = dp_shard * cp, tp)  the tp-split layers: weights Shard over
                                                          tp, FSDP2 over the rest
    expert mesh:  (dp_replicate, efsdp, ep[, tp])         ep borrows ranks from dp_shard * cp
                                                          (torchtitan's way): routed experts are
                                                          Shard(0) over ep, FSDP2 over the rest
                                                          (tp included: experts are not split)
    tp mesh:      the layer mesh's tp: the ranks that split every layer's heads / FFN width
                  (mmtrain/parallel/tensor_parallel.py)
    pp mesh:      the pipeline stages
    data:         dp rank = (rank // (cp * tp)) % (dp_replicate * dp_shard); the ranks of one cp,
                  tp or pp group read the same rows

Every mesh is unflattened from one world mesh (with its pp and tp dims when they are > 1, then
sliced to the named dims), so FSDP2 accepts an expert weight that is a
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
    tp: int = 1
    pp: int = 1
    _meshes: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, cfg: DistConfig, world_size: int, rank: int = 0) -> ParallelDims:
        """Resolve `dp_shard: -1` (the rest of the world) and check that the sizes fit the world.
        One process has no mesh: the keys describe a launch, so `configs/base.yaml` also runs alone."""
        if world_size == 1:
            return cls(1, 1, 1, 1, 1, rank)
        if cfg.strategy == "ddp":
            if cfg.dp_shard not in (-1, 1) or (cfg.cp, cfg.ep, cfg.tp, cfg.pp) != (1, 1, 1, 1):
                raise UserError("dist.strategy: ddp replicates the whole model; dist.dp_shard, dist.cp, "
                                "dist.ep, dist.tp and dist.pp need fsdp (got "
                                f"{cfg.dp_shard}, {cfg.cp}, {cfg.ep}, {cfg.tp}, {cfg.pp})")
            if cfg.dp_replicate not in (1, world_size):
                raise UserError(f"dist.dp_replicate: ddp replicates over the whole world {world_size} "
                                f"(got {cfg.dp_replicate})")
            return cls(world_size, 1, 1, 1, world_size, rank)
        rest, dp_shard = cfg.pp * cfg.dp_replicate * cfg.cp * cfg.tp, cfg.dp_shard
        if dp_shard == -1:
            dp_shard = world_size // rest if world_size % rest == 0 else 0
        if rest * dp_shard != world_size:
            raise UserError(f"dist.pp x dist.dp_replicate x dist.dp_shard x dist.cp x dist.tp must equal the "
                            f"world size {world_size} (got {cfg.pp} x {cfg.dp_replicate} x {cfg.dp_shard} x "
                            f"{cfg.cp} x {cfg.tp})")
        if (dp_shard * cfg.cp) % cfg.ep:
            raise UserError(f"dist.ep: must divide dist.dp_shard x dist.cp = {dp_shard * cfg.cp} "
                            f"(got {cfg.ep})")
        return cls(cfg.dp_replicate, dp_shard, cfg.cp, cfg.ep, world_size, rank, cfg.tp, cfg.pp)

    def refuse_unimplemented(self) -> None:
        """The mesh keys that parse but have no implementation in the caller: one line naming the key.
        Its callers are `build_model` (which dist.pp > 1 never reaches: the trainer builds stages,
        mmtrain/parallel/pipeline_model.py) and `mmtrain plan`, which does not model pp."""
        for key, size in (("pp", self.pp),):
            if size > 1:
                raise UserError(f"dist.{key}: {size} is not implemented yet (use dist.{key}: 1)")

    # ----- sizes and this rank's coordinates ---------------------------------------------------
    @property
    def dp_size(self) -> int:
        """Ranks that read different data (the global batch is dp_size x the per-rank batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        """The data slot: the ranks of one cp, tp or pp group share it (they read the same rows)."""
        return self.rank // (self.cp * self.tp) % self.dp_size

    @property
    def cp_rank(self) -> int:
        return self.rank // self.tp % self.cp

    @property
    def seq_rank(self) -> int:
        """This rank's chunk of every row: (cp, tp) flattened (sequence parallelism splits a cp chunk)."""
        return self.rank % (self.cp * self.tp)

    @property
    def seq_size(self) -> int:
        return self.cp * self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.world_size // self.pp)

    def rank_of(self, dp: int, cp: int = 0, tp: int = 0, pp: int = 0) -> int:
        """The world rank at these coordinates (dp: dp_replicate x dp_shard flattened)."""
        return ((pp * self.dp_size + dp) * self.cp + cp) * self.tp + tp

    @property
    def efsdp(self) -> int:
        return self.dp_shard * self.cp // self.ep

    @property
    def sharded(self) -> bool:
        return self.dp_shard * self.cp > 1

    def describe(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("tp", self.tp), ("pp", self.pp)) if v > 1)
        return (f"mesh dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp} "
                f"ep={self.ep}{extra} (world {self.world_size})")

    # ----- meshes (built on first use: they need the process group) ------------------------------
    def dense_mesh(self, device_type: str):
        """(dp_replicate, fsdp): FSDP2's mesh for every parameter that is neither a routed expert nor
        a tp-split weight. `fsdp` includes tp: under sequence parallelism a tp rank holds distinct
        tokens, so these parameters' gradients are partial per tp rank and FSDP's reduce sums them
        (mmtrain/parallel/tensor_parallel.py)."""
        return self._mesh(device_type, "dense", (self.dp_replicate, self.dp_shard * self.cp * self.tp),
                          ("dp_replicate", "fsdp"), with_tp=False)

    def layer_mesh(self, device_type: str):
        """(dp_replicate, fsdp = dp_shard x cp, tp) (tp > 1): the tp-split decoder layers' mesh. Their
        matmul weights are DTensors Shard over `tp`; FSDP2 shards them over the rest
        (`layer_fsdp_mesh`), a slice of the same mesh, as FSDP2 requires of a 2-D parameter."""
        assert self.tp > 1, "no layer mesh at tp = 1"
        return self._mesh(device_type, "layer", (self.dp_replicate, self.dp_shard * self.cp, self.tp),
                          ("dp_replicate", "fsdp", "tp"), with_tp=False)

    def layer_fsdp_mesh(self, device_type: str):
        """FSDP2's mesh for a tp-split layer: (dp_replicate, fsdp) (HSDP) or fsdp alone."""
        mesh = self.layer_mesh(device_type)
        return mesh["dp_replicate", "fsdp"] if self.dp_replicate > 1 else mesh["fsdp"]

    def seq_mesh(self, device_type: str):
        """(dp_replicate, dp_shard, seq = cp x tp): a `seq` group splits the same rows between its ranks."""
        return self._mesh(device_type, "seq", (self.dp_replicate, self.dp_shard, self.cp * self.tp),
                          ("dp_replicate", "dp_shard", "seq"), with_tp=False)

    def expert_mesh(self, device_type: str):
        """(dp_replicate, efsdp, ep[, tp]): `ep` shards the experts, the rest is their FSDP2 mesh
        (`expert_fsdp_mesh`). (efsdp, ep) is also flattened, so a DTensor op that reduces over both
        finds one group (the gradient norm, parallelize._mesh_norm, reduces per dim: a scalar each)."""
        fresh = "expert" not in self._meshes
        tp = ((self.tp,), ("tp",)) if self.tp > 1 else ((), ())
        mesh = self._mesh(device_type, "expert", (self.dp_replicate, self.efsdp, self.ep, *tp[0]),
                          ("dp_replicate", "efsdp", "ep", *tp[1]), with_tp=False)
        if fresh:
            mesh["efsdp", "ep"]._flatten("efsdp_ep")
        return mesh

    def expert_fsdp_mesh(self, device_type: str):
        """FSDP2's mesh for the routed experts: (dp_replicate, efsdp) (HSDP) or efsdp alone; under tp
        efsdp x tp flattened. The experts are replicated over tp, not split (no expert-TP): sequence
        parallelism gives each tp rank its own tokens, which it routes and dispatches in its own ep
        group (its tp coordinate), so an expert's gradient is partial on each tp rank and FSDP2's
        reduce-scatter must sum it over tp too, as the dense mesh's `fsdp` (tp included) does."""
        if "expert_fsdp" not in self._meshes:
            mesh = self.expert_mesh(device_type)
            rep = self.dp_replicate > 1
            if self.tp == 1:
                part = mesh["dp_replicate", "efsdp"] if rep else mesh["efsdp"]
            else:  # non-adjacent dims: flattened (rank order dp_replicate, efsdp, tp), then split
                flat = mesh["dp_replicate", "efsdp", "tp"]._flatten("dp_efsdp_tp")
                part = flat._unflatten(0, (self.dp_replicate, self.efsdp * self.tp),
                                       ("dp_replicate", "efsdp_tp"))
                part = part if rep else part["efsdp_tp"]
            self._meshes["expert_fsdp"] = part
        return self._meshes["expert_fsdp"]

    def cp_mesh(self, device_type: str):
        """(dp_replicate, dp_shard, cp): a `cp` group is the ranks that split the same rows."""
        return self._mesh(device_type, "cp", (self.dp_replicate, self.dp_shard, self.cp),
                          ("dp_replicate", "dp_shard", "cp"))

    def tp_mesh(self, device_type: str):
        """(tp,): the ranks that split every layer's heads and FFN width (tp > 1)."""
        assert self.tp > 1, "no tp mesh at tp = 1"
        return self.layer_mesh(device_type)["tp"]

    def stage_mesh(self, device_type: str):
        """(stage,): every rank of this rank's pipeline stage (the world when pp = 1): the ranks that run
        the same layers at the same time, so the ones a collective inside a layer may span."""
        return self._mesh(device_type, "stage", (self.world_size // self.pp,), ("stage",), with_tp=False)

    def pp_mesh(self, device_type: str):
        """(pp,): the pipeline stages that hold the same data slot and tp coordinate (pp > 1)."""
        assert self.pp > 1, "no pp mesh at pp = 1"
        return self._mesh(device_type, "pp", (self.dp_size * self.cp,), ("dp_cp",))["pp"]

    def _mesh(self, device_type: str, name: str, sizes: tuple[int, ...], names: tuple[str, ...],
              with_tp: bool = True):
        """The world unflattened to (pp, *names, tp), pp and tp only when > 1 (tp: only `with_tp`,
        else `sizes` include it), sliced to `names` (to the full mesh for `tp` / `pp`)."""
        if name not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            if "world" not in self._meshes:
                self._meshes["world"] = init_device_mesh(device_type, (self.world_size,),
                                                         mesh_dim_names=("world",))
            pp = ((self.pp,), ("pp",)) if self.pp > 1 else ((), ())
            tp = ((self.tp,), ("tp",)) if self.tp > 1 and with_tp else ((), ())
            full = self._meshes["world"]._unflatten(0, pp[0] + sizes + tp[0], pp[1] + names + tp[1])
            self._meshes[name] = full if name in ("tp", "pp") or full.ndim == len(names) else full[names]
        return self._meshes[name]
