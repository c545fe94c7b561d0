"""Does a checkpoint's ViT see colour, shape and size? The linear probe (mmtrain/evaluation/probe.py)
on its first N val images with object boxes: held-out accuracy of the projected tokens (vit), the
merged features before the projector (vit_pre) and the raw pixels (the reference), against chance.

    python -m tools.probe_media --ckpt runs/tiny [--media 100] [--json]   (a run, checkpoint or export)
"""

from __future__ import annotations

import argparse
import json
import sys

from mmtrain.errors import UserError, run_guarded
from mmtrain.evaluation.probe import FEATURES, probe_media, probe_scores
from mmtrain.inference.loading import checkpoint_line, load_model


def probe(ckpt: str, n: int) -> dict:
    """{attribute: {"vit", "vit_pre", "pixels", "chance", "n", "held_out"}} (probe.probe_scores)."""
    loaded = load_model(ckpt)
    print(checkpoint_line(ckpt, loaded.path), file=sys.stderr)
    media = probe_media(loaded.cfg.data, loaded.tokenizer, n)
    if not media:
        raise UserError(f"--ckpt {ckpt}: no val image with object boxes in the checkpoint's data.val")
    return probe_scores(loaded.model, media, loaded.device, loaded.model)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="RUN/step_<N>, a run directory (its newest valid "
                                                 "checkpoint) or an `mmtrain export` directory")
    p.add_argument("--media", type=int, default=100, help="val images with boxes to probe (default 100)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    return run_guarded(lambda: _report(args))


def _report(args: argparse.Namespace) -> int:
    if args.media < 3:
        raise UserError(f"--media: need at least 3 images (one in three is held out) (got {args.media})")
    result = probe(args.ckpt, args.media)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    columns = (*FEATURES, "chance")
    print(f"{'attribute':<10}{'objects':>8}{'held out':>9}" + "".join(f"{k:>9}" for k in columns))
    for attr, r in result.items():
        accs = "".join(f"{r[k]:>9.2f}" for k in columns)
        print(f"{attr:<10}{r['n']:>8}{r['held_out']:>9}{accs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
