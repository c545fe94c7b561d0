"""`mmtrain data inspect SHARDS...`: what the loader would make of these shards.

Runs the real pipeline once over the shards (one deterministic pass, no failure-rate abort)
and prints samples per kind, bad samples by reason (with the first ledger entries), text and
visual token counts, and the packing efficiency at --seq-len.
"""

from __future__ import annotations

import argparse
import json

import yaml

from mmtrain.data_pipelines.config import DataConfig, MediaConfig, SourceConfig
from mmtrain.data_pipelines.documents import KINDS
from mmtrain.data_pipelines.errors import DataError
from mmtrain.data_pipelines.loader import build_loader
from mmtrain.data_pipelines.tokenizer import load_tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shards", nargs="+", help="shard specs: paths, globs, brace ranges, directories, pipe:")
    p.add_argument("--seq-len", type=int, default=1024, help="packed row length (default 1024)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per batch while packing (default 8)")
    p.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json path (default byte)")
    p.add_argument("--patch-size", type=int, default=MediaConfig.patch_size)
    p.add_argument("--merge", type=int, default=MediaConfig.merge)
    p.add_argument("--min-pixels", type=int, default=MediaConfig.min_pixels)
    p.add_argument("--max-pixels", type=int, default=MediaConfig.max_pixels)
    p.add_argument("--max-image-pixels", type=int, default=MediaConfig.max_image_pixels,
                   help="larger images count as bad (too_large)")
    p.add_argument("--show-bad", type=int, default=10, help="ledger entries to list (default 10)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="any data config field, e.g. --set max_member_bytes=1000000 --set "
                        "media.video_max_frames=4 --set shard_retries=0 (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def inspect_shards(args: argparse.Namespace) -> dict:
    media = MediaConfig(patch_size=args.patch_size, merge=args.merge,
                        min_pixels=args.min_pixels, max_pixels=args.max_pixels,
                        max_image_pixels=args.max_image_pixels)
    fields = {"val": [SourceConfig("inspect", list(args.shards))], "seq_len": args.seq_len,
              "batch_size": args.batch_size, "num_workers": 0, "max_failure_rate": 1.0}
    media_fields = {k: getattr(media, k) for k in MediaConfig.__dataclass_fields__}
    for item in args.overrides:
        key, _, value = item.partition("=")
        is_media = key.startswith("media.")
        target, name = (media_fields, key[6:]) if is_media else (fields, key)
        if name not in (MediaConfig if is_media else DataConfig).__dataclass_fields__ or \
                name in ("train", "val", "media"):
            raise DataError(f"--set {item}: no data config field {key!r}")
        target[name] = yaml.safe_load(value)
    try:
        cfg = DataConfig(**fields, media=MediaConfig(**media_fields))
    except (TypeError, ValueError) as e:
        raise DataError(f"--set: {e}") from None
    loader = build_loader(cfg, load_tokenizer(args.tokenizer), "val")
    for _ in loader:
        pass
    st = loader.stats()
    kinds = {}
    for kind in KINDS:
        n = st["kinds"].get(kind, 0)
        text, visual = st["kind_tokens"].get(f"{kind}/text", 0), st["kind_tokens"].get(f"{kind}/visual", 0)
        kinds[kind] = {"samples": n, "text_tokens": text, "visual_tokens": visual,
                       "mean_tokens": (text + visual) / n if n else 0.0}
    src = st["sources"]["inspect"]
    return {
        "shards": len(loader.sources[0].urls),
        "samples": st["samples"],
        "good": src["ok"],
        "kinds": kinds,
        "bad": dict(sorted(st["skipped"].items())),
        "bad_examples": [list(e) for e in loader.ledger.entries[: args.show_bad]],
        "tokens": {"text": src["text_tokens"], "visual": src["visual_tokens"],
                   "max_doc": src["max_doc_tokens"]},
        "seq_len": args.seq_len,
        "batches": st["batches"],
        "packing_efficiency": st["packing_efficiency"],
    }


def _print(report: dict) -> None:
    print(f"{report['shards']} shards, {report['samples']} samples read, {report['good']} good")
    print(f"{'kind':<12}{'samples':>9}{'text tok':>11}{'visual tok':>12}{'tok/sample':>12}")
    for kind, k in report["kinds"].items():
        print(f"{kind:<12}{k['samples']:>9}{k['text_tokens']:>11}{k['visual_tokens']:>12}{k['mean_tokens']:>12.1f}")
    bad = report["bad"]
    print(f"bad samples: {sum(bad.values())}" + "".join(f"\n  {r:<16}{n:>7}" for r, n in bad.items()))
    for shard, key, reason in report["bad_examples"]:
        print(f"    {reason:<16} {shard} {key}")
    t = report["tokens"]
    print(f"tokens: text {t['text']}, visual {t['visual']}, longest document {t['max_doc']}")
    print(f"packing at seq_len {report['seq_len']}: {report['packing_efficiency']:.1%} non-padding "
          f"over {report['batches']} batches")


def run(args: argparse.Namespace) -> int:
    report = inspect_shards(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0
