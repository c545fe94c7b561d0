"""Pipeline parity worker: `torchrun --nproc-per-node PP pipeline_worker.py CONFIG OUT SCHEDULE STEPS`.

Every rank reads the same STEPS x grad_accum micro-batches, trains the one-process reference on them
(the Objective's micro_batch, backward of loss / accum, clip, AdamW, MoE bias step), then the same
initial weights as pipeline stages over all ranks (the pp group is the world here: dp = 1), and rank
0 writes both runs' per-step losses, task losses, gradient norms and final expert biases to OUT.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml


def reference(cfg, model, batches, steps, accum):
    from mmtrain.objectives.balance import build_balancer
    from mmtrain.objectives.objective import Objective
    from mmtrain.optim import build_optimizer
    from mmtrain.parallel.distributed import DistEnv
    from mmtrain.parallel.parallelize import checkpoint_forward, clip_grad_norm, prime_probes

    if cfg.dist.activation_checkpointing:
        prime_probes(torch.device("cpu"))
        for block in [*model.vision.blocks, *model.decoder.layers]:
            checkpoint_forward(block)
    obj = Objective(cfg, model, _balancer(cfg, build_balancer), env=DistEnv(), device=torch.device("cpu"))
    opt = build_optimizer(model, cfg.optim)
    out = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        sums = obj.begin_step(step)
        for b in batches[step * accum:(step + 1) * accum]:
            loss = obj.micro_batch(b, sums)
            (loss / accum).backward()
            sums.loss = sums.loss + loss.detach().double() / accum
        norm = clip_grad_norm(model, cfg.optim.grad_clip)
        opt.step()
        model.update_moe_bias()
        out.append(_record(sums.floats(), float(norm)))
    bias = {str(i): m.router.expert_bias_E.tolist() for i, m in model.moe_layers().items()}
    return out, bias


def pipelined(cfg, model, batches, steps, accum, schedule, rank, world):
    from mmtrain.loop.pipeline_step import PipelineStep
    from mmtrain.objectives.balance import build_balancer
    from mmtrain.objectives.objective import Objective
    from mmtrain.optim import build_optimizer
    from mmtrain.parallel.distributed import DistEnv
    from mmtrain.parallel.pipeline import (
        block_stage,
        build_stage_models,
        checkpoint_stages,
        pp_grad_norm,
        stage_ranges,
        stage_rank,
    )
    from mmtrain.parallel.pipeline_replica import PipelineReplica

    device = torch.device("cpu")
    ranges = stage_ranges(model, schedule, world, cfg.data.seq_len, cfg.dist.pp_vision_stage)
    replica = PipelineReplica(cfg.model, model.init_seed, rank == 0, device)  # before the split prunes
    parts = build_stage_models(model, schedule, rank, world, cfg.data.seq_len, ranges=ranges)
    if cfg.dist.activation_checkpointing:
        checkpoint_stages(parts, device)
    last = next((p for p in parts if p.is_last), parts[-1])
    env = DistEnv(rank, world)
    obj = Objective(cfg, last, _balancer(cfg, build_balancer), env=env, device=device, raw_model=last,
                    pp=world)
    step_fn = PipelineStep(obj, parts, schedule, None, device, accum)
    opts = [build_optimizer(p, cfg.optim) for p in parts]
    out = []
    for step in range(steps):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        sums = obj.begin_step(step)
        sums.loss = step_fn.run(batches[step * accum:(step + 1) * accum], sums)
        norm = pp_grad_norm(parts, None, cfg.optim.grad_clip)
        for opt in opts:
            opt.step()
        for p in parts:
            p.update_moe_bias()
        out.append(_record(sums.reduce(env, device), float(norm)))
    bias = {str(i): m.router.expert_bias_E.tolist() for p in parts for i, m in p.moe_layers().items()}
    every = [None] * world
    dist.all_gather_object(every, bias)
    # every stage's weights, named, block by block into rank 0's host replica
    owner = lambda name: stage_rank(schedule, block_stage(name, ranges), world)  # noqa: E731
    replica.refresh(parts, owner, dist.group.WORLD)
    return out, {k: v for b in every for k, v in b.items()}, replica.host_state() if rank == 0 else None


def _balancer(cfg, build_balancer):
    from mmtrain.data_pipelines.batch import TASK_NAMES

    return build_balancer(cfg.loss.balancer, {t: getattr(cfg.loss, t) for t in TASK_NAMES})


def _record(total, norm: float) -> dict:
    n = total.task_tokens
    return {"loss": float(total.loss), "grad_norm": norm,
            "task_loss": {t: float(total.task_ce[t]) / float(n[t]) for t in n if float(n[t])},
            "tokens": float(total.tokens)}


def main(config: str, out: str, schedule: str, steps: int) -> None:
    from mmtrain.config import from_dict
    from mmtrain.data_pipelines.loader import build_loader
    from mmtrain.data_pipelines.tokenizer import load_tokenizer
    from mmtrain.models.multimodal import MultimodalModel
    from mmtrain.run_config import RunConfig
    from mmtrain.state.train_state import seed_everything

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = from_dict(RunConfig, yaml.safe_load(Path(config).read_text()), source=config)
    tok = load_tokenizer(cfg.data.tokenizer)
    cfg.model.decoder.vocab_size = tok.vocab_size
    accum = cfg.train.grad_accum
    it = iter(build_loader(cfg.data, tok, "train", 0, 1))
    batches = [next(it) for _ in range(steps * accum)]
    seed_everything(cfg.train.seed)
    model = MultimodalModel(cfg.model)
    ref_model = copy.deepcopy(model)
    ref, ref_bias = reference(cfg, ref_model, batches, steps, accum)
    pp, pp_bias, full = pipelined(cfg, model, batches, steps, accum, schedule, rank, world)
    ref_sd, full_sd = ref_model.state_dict(), full or {}
    weight_diff = max((float((ref_sd[k].double() - full_sd[k].double()).abs().max()) for k in ref_sd
                       if k in full_sd and not k.startswith("visual_head.")
                       and ref_sd[k].is_floating_point()), default=None)
    media = sum(int(b.grid_thw_M3.shape[0]) for b in batches)
    video = sum(int((b.modality_BS == 2).sum()) for b in batches)  # video tokens
    if rank == 0:
        Path(out).write_text(json.dumps({"ref": ref, "pp": pp, "ref_bias": ref_bias, "pp_bias": pp_bias,
                                         "media": media, "video": video, "weight_diff": weight_diff}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
