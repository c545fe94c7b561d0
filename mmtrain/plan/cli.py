"""`mmtrain plan CONFIG --gpus N --gpu NAME [--set ...] [--rank R] [--json]`: memory per rank,
collectives, FLOPs and a roofline step time of the config's real training step at N ranks, on
fake tensors (mmtrain/plan/trace.py). Exits 3 with the numbers when the peak does not fit."""

from __future__ import annotations

import argparse
import json

NO_FIT = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML, e.g. configs/base.yaml")
    parser.add_argument("--gpus", type=int, required=True, help="ranks of the launch (the world size)")
    parser.add_argument("--gpu", default="h100", help="GPU model: a100, h100, h200, b200, mi300x")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, as for train (repeatable)")
    parser.add_argument("--rank", type=int, default=0, help="the rank to report (default 0: under the "
                        "plan's balanced batch every rank carries the same load, rank 0 the EP imbalance)")
    parser.add_argument("--visual-frac", type=float, default=0.5,
                        help="share of a row's tokens that are image tokens")
    parser.add_argument("--ep-imbalance", type=float, default=1.0,
                        help="rows this rank's experts receive / the uniform share (EP)")
    parser.add_argument("--keep-rate", type=float, default=None,
                        help="sparse layers' kept share of the causal pairs (default: the rule's cap)")
    parser.add_argument("--exact", action="store_true", help="every layer traced, under torch's own "
                        "memory bookkeeping (the reference of the fast plan: one layer per kind traced "
                        "and scaled, mmtrain/plan/layers.py; slower)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    plan = make_plan(args.config, args.gpus, args.gpu, args.overrides, rank=args.rank,
                     visual_frac=args.visual_frac, ep_imbalance=args.ep_imbalance, keep_rate=args.keep_rate,
                     exact=args.exact)
    from mmtrain.plan.loader import loader_need
    from mmtrain.plan.report import text

    step_s = plan["roofline"]["step_s_overlapped"]
    plan["loader"] = loader_need(_config(args), step_s)  # in the CLI only: it reads the config's data
    print(json.dumps(plan, indent=1) if args.json else text(plan))
    return 0 if plan["memory"]["fits"] else NO_FIT


def make_plan(config: str, gpus: int, gpu_name: str, overrides=(), scaled: bool | None = None,
              **options) -> dict:
    """scaled: trace one layer per kind and scale (layers.py); None: when that traces fewer blocks
    (never with exact=True, the reference path)."""
    from mmtrain.config import load_config
    from mmtrain.errors import UserError
    from mmtrain.plan import report
    from mmtrain.plan.gpus import gpu
    from mmtrain.plan.trace import PlanOptions, dims_for
    from mmtrain.run_config import RunConfig

    spec = gpu(gpu_name)
    if gpus < 1:
        raise UserError(f"--gpus: must be >= 1 (got {gpus})")
    cfg = load_config(RunConfig, config, list(overrides))
    cfg.model.decoder.vocab_size = cfg.model.decoder.vocab_size or 32768
    if not 0 <= options.get("rank", 0) < gpus:
        raise UserError(f"--rank: must be in [0, {gpus}) (got {options['rank']})")
    dims = dims_for(cfg, gpus, options.get("rank", 0))  # a mesh that does not fit: one line, before any work
    params = _params(cfg)
    opts = PlanOptions(gpus=gpus, per_node=spec.per_node, **options)
    if dims.pp == 1:
        result = _trace(cfg, opts, scaled)
    else:  # this rank's stages on its stage's data-parallel ranks, then the schedule (pipe.py)
        from dataclasses import replace

        from mmtrain.plan.pipe import pipelined, stage_config, stage_plan

        info = stage_plan(cfg, dims)
        per_stage = gpus // dims.pp
        sub = replace(opts, gpus=per_stage, rank=opts.rank % per_stage)
        result = pipelined(_trace(stage_config(cfg, info), sub, scaled), info, cfg, dims, spec.per_node)
    from mmtrain.plan.vision import vision_costs

    vision = vision_costs(cfg.vision, result.media_patches, result.mesh)
    plan = report.build(config, result, spec, gpus, params, vision)
    if dims.pp > 1 and dims.tp > 1:  # the trainer runs it, tested at 2 x 2 (x FSDP(2) x EP(2)) only
        plan["caveat"] = ("dist.tp with dist.pp > 1: planned from the TP and PP halves the plan traces; "
                          "the trainer runs it, tested at TP(2) x PP(2) (x FSDP(2) x EP(2)) on gloo")
    return plan


def _config(args: argparse.Namespace):
    from mmtrain.config import load_config
    from mmtrain.run_config import RunConfig

    return load_config(RunConfig, args.config, list(args.overrides))


def _trace(cfg, opts, scaled: bool | None):
    from mmtrain.plan.layers import scaled_trace, worth_it
    from mmtrain.plan.trace import trace

    if scaled is None:
        scaled = not opts.exact and worth_it(cfg)
    return scaled_trace(cfg, opts) if scaled else trace(cfg, opts)


def _params(cfg) -> dict:
    import torch

    from mmtrain.models.counting import count_params
    from mmtrain.models.multimodal import MultimodalModel

    with torch.device("meta"):
        counts = count_params(MultimodalModel(cfg.model))
    return {"total": counts.total, "active": counts.active, "vision": counts.vision}
