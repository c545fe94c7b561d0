"""A checkpoint's captions table on more val media than the training eval's: does its text name
what the objects are?

The training eval captions 8 val images and 4 videos (`captions`); one hit there moves an accuracy
by 8-25 points. This captions the first `--images` / `--videos` val media greedily, with real and
with blanked media, and scores each attribute word against key.json as the eval does
(mmtrain/evaluation/captioning.py), beside a text-only reference: `majority`, the accuracy of
naming every reference word with the attribute's most frequent value.

    python -m tools.caption_table --ckpt runs/tiny [--images 64 --videos 32] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter

from mmtrain.errors import run_guarded
from mmtrain.evaluation.captioning import ATTRIBUTES, CaptionSet, build_caption_set, run_captioning
from mmtrain.inference.loading import checkpoint_line, load_model


def majority(cs: CaptionSet) -> dict[str, float]:
    """attribute (reported name) -> share of its reference words equal to its most frequent value."""
    out = {}
    for attr, name in ATTRIBUTES.items():
        words = Counter(w for truth in cs.truths for w in truth.get(attr, []))
        if words:
            out[name] = words.most_common(1)[0][1] / sum(words.values())
    return out


def table(res, chance: dict[str, float]) -> str:
    lines = ["| attribute | words | real media | blanked media | majority |", "|---|---|---|---|---|"]
    for a, acc in res.accuracy.items():
        blank, ref = res.blank_accuracy[a], chance.get(a, 0.0)
        lines.append(f"| {a} | {res.words[a]} | {acc:.0%} | {blank:.0%} | {ref:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="a run, checkpoint or export directory")
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--videos", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    m = load_model(args.ckpt, args.device)
    cfg = dataclasses.replace(m.cfg.captions, images=args.images, videos=args.videos,
                              scan=max(m.cfg.captions.scan, 2 * (args.images + args.videos)))
    cs = build_caption_set(m.cfg.data, cfg)
    if cs.note:
        print(cs.note, file=sys.stderr)
        return 1
    res = run_captioning(m, cs, cfg, step=-1)
    chance = majority(cs)
    if args.json:
        print(json.dumps({**res.to_dict(), "majority": chance}, indent=1))
    else:
        print(checkpoint_line(args.ckpt, m.path))
        print(f"{res.prompts} val media captioned greedily (max {cfg.max_new_tokens} new tokens)")
        print(table(res, chance))
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(main))
