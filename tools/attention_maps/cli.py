"""`mmtrain-attn` (also `mmtrain attn`): where text tokens look in images and video.

    mmtrain-attn --ckpt runs/tiny --image shapes.png --text "a red circle" --out attn/
    mmtrain-attn --ckpt runs/tiny --shard data/shapes/val/video-000000.tar --key vid_00000003 \
        --out attn/
    mmtrain-attn --ckpt runs/tiny --from-val 50 --out attn-val/

Writes OUT/report.html (self-contained), OUT/metrics.json and the pictures (see docs/ATTENTION_MAPS.md).
This module imports only argparse at import time: `mmtrain` builds its parser from it.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, help="RUN/step_<N>, a run directory (its newest valid "
                                                 "checkpoint, e.g. runs/tiny) or an export directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--image", metavar="FILE", help="an image file (with --text)")
    src.add_argument("--video", metavar="FILE", help="a video file (with --text)")
    src.add_argument("--shard", metavar="TAR", help="a webdataset shard (with --key)")
    src.add_argument("--from-val", type=int, metavar="N",
                     help="aggregate over N held-out samples with media from the checkpoint's val split")
    p.add_argument("--key", help="sample key inside --shard")
    p.add_argument("--text", help="text after the medium (replaces a --shard sample's caption)")
    p.add_argument("--layers", default="all", help="decoder layers, e.g. 0,2,-1 (default: all)")
    p.add_argument("--heads", default="mean", help="maps per head: mean (default), all, or a list like 0,3")
    p.add_argument("--tokens", help="only draw maps for these tokens/words, e.g. red,circle")
    p.add_argument("--boxes", metavar="JSON",
                   help="object boxes for --image/--video (file or inline JSON): key.json-style objects "
                        "[{\"color\": \"red\", \"box\": [x0, y0, x1, y1]}] or {\"word\": [x0, y0, x1, y1]}")
    p.add_argument("--query", choices=("token", "predictor"), default="token",
                   help="rows drawn: the token's own (default) or the one predicting it")
    p.add_argument("--examples", type=int, default=3, help="--from-val: documents rendered in the report")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, or auto")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: per-document inputs are small; 0 = torch's default)")
    p.add_argument("--chunk", type=int, default=32, help="query rows recomputed at once")
    p.add_argument("--faithfulness", action=argparse.BooleanOptionalAction, default=None,
                   help="knockout faithfulness of every map method (default: on for --from-val)")
    p.add_argument("--draws", type=int, default=20, help="--faithfulness: random orders a word (default 20)")
    p.add_argument("--sanity", action="store_true",
                   help="--faithfulness: also the randomisation check (maps after re-initialising weights)")
    p.add_argument("--out", required=True, help="output directory")


def _check(args) -> None:
    from mmtrain.errors import UserError

    if args.shard and not args.key:
        raise UserError("--shard needs --key KEY (the sample to show)")
    if args.key and not args.shard:
        raise UserError("--key goes with --shard TAR")
    if args.from_val is not None and args.from_val < 1:
        raise UserError(f"--from-val: need N >= 1 (got {args.from_val})")
    if (args.image or args.video) and not args.text:
        raise UserError("--image/--video need --text \"...\" (the text whose attention to show)")
    if args.boxes and (args.from_val is not None):
        raise UserError("--boxes applies to --image/--video/--shard, not --from-val (val samples have boxes)")
    if args.chunk < 1 or args.examples < 0 or args.threads < 0:
        raise UserError("--chunk must be >= 1, --examples and --threads >= 0")
    if args.draws < 2:
        raise UserError(f"--draws: need >= 2 random orders (got {args.draws})")
    if args.sanity and args.faithfulness is False:
        raise UserError("--sanity checks the faithfulness maps: drop --no-faithfulness")


def run(args: argparse.Namespace) -> int:
    import torch

    from mmtrain.errors import UserError

    from . import session

    _check(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    s = session.Session.open(args)
    try:
        out = s.run_single() if args.from_val is None else s.run_val()
    except OSError as e:
        raise UserError(f"--out {args.out}: cannot write: {e.strerror or e}") from None
    for line in out:
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    from mmtrain.errors import run_guarded

    parser = argparse.ArgumentParser(prog="mmtrain-attn", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return run_guarded(lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
