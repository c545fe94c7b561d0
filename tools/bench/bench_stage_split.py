"""The pipeline split by the FLOP model against the split by measured time, on this machine.

    python -m tools.bench.bench_stage_split configs/tiny.yaml [--stages 2 3 4] [--vision-stage] [--set K=V]

Prints each part's cost as a share of one decoder layer's (layer 0's) under `stage_costs` (FLOPs) and
under `measured_costs` (one forward + backward timed on this rank's device at the config's shapes,
mmtrain/parallel/stage_timing.py), then both splits for each stage count: where the FLOP model and
the clock disagree enough to move a cut, `dist.pp_split: measured` is worth its launch-time cost.
"""

from __future__ import annotations

import argparse


def main(argv=None) -> None:
    import torch

    from mmtrain.config import load_config
    from mmtrain.models.multimodal import MultimodalModel
    from mmtrain.parallel.pipeline import split_layers, stage_costs
    from mmtrain.parallel.stage_timing import measured_costs
    from mmtrain.run_config import RunConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--vision-stage", action="store_true", help="dist.pp_vision_stage's split")
    ap.add_argument("--set", action="append", default=[], help="config override KEY=VALUE")
    args = ap.parse_args(argv)
    cfg = load_config(RunConfig, args.config, args.set)
    cfg.model.decoder.vocab_size = cfg.model.decoder.vocab_size or 32768
    cuda = cfg.train.device in ("auto", "cuda") and torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    model = MultimodalModel(cfg.model).to(device)
    both = {"flops": stage_costs(model, cfg.data.seq_len), "measured": measured_costs(model, cfg, device)}
    print(f"{args.config} on {device}: B {cfg.data.batch_size} x S {cfg.data.seq_len}; cost / layer 0's")
    for name, c in both.items():
        unit = c["layers"][0]
        layers = " ".join(f"{x / unit:.2f}" for x in c["layers"])
        parts = [f"vision {c['vision'] / unit:.2f}", f"layers {layers}", f"head {c['head'] / unit:.2f}"]
        print(f"  {name:8s} {'; '.join(parts)}")
    for n in args.stages:
        cuts = {k: [[r.start, r.stop] for r in split_layers(c, n, args.vision_stage)]
                for k, c in both.items()}
        print(f"  {n} stages: flops {cuts['flops']}  measured {cuts['measured']}")


if __name__ == "__main__":
    main()
