"""`mmtrain data synth`: argparse wiring for write_corpus (the lead's CLI calls these two)."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace

from mmtrain.data_pipelines.errors import DataError
from mmtrain.data_pipelines.synth.config import SynthConfig
from mmtrain.data_pipelines.synth.writer import write_corpus

# (flag, config field, help); every flag defaults to None = "keep the preset's value".
_FLAGS = (
    ("--seed", "seed", "corpus seed; same seed => byte-identical files"),
    ("--n-image", "n_image", "train image-text samples"),
    ("--n-video", "n_video", "train video-text samples"),
    ("--n-interleaved", "n_interleaved", "train interleaved documents"),
    ("--n-text", "n_text", "train text-only documents"),
    ("--n-val", "n_val", "val samples per kind"),
    ("--shard-size", "shard_size", "samples per shard"),
    ("--image-size", "image_size", "image side in pixels"),
    ("--video-size", "video_size", "video side in pixels (even)"),
    ("--frames", "frames", "frames per clip"),
    ("--fps", "fps", "clip frame rate"),
    ("--min-images", "min_images", "images per interleaved document, at least"),
    ("--max-images", "max_images", "images per interleaved document, at most (<= 9)"),
    ("--vocab-size", "vocab_size", "BPE vocabulary size (upper bound)"),
    ("--workers", "workers", "render processes, 0 = one per core (output does not depend on it)"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = {f.name: f.default for f in fields(SynthConfig)}
    parser.add_argument("--out", required=True, help="output directory (files it writes are replaced)")
    parser.add_argument("--small", action="store_true", help="tiny preset for tests and smoke runs")
    for flag, name, help_ in _FLAGS:
        parser.add_argument(flag, type=int, default=None, help=f"{help_} (default {defaults[name]})")


def config_from_args(args: argparse.Namespace) -> SynthConfig:
    overrides = {name: getattr(args, name) for _, name, _ in _FLAGS if getattr(args, name, None) is not None}
    try:
        return SynthConfig.small(**overrides) if args.small else replace(SynthConfig(), **overrides)
    except ValueError as e:
        raise DataError(f"data synth: {e}") from None


def run(args: argparse.Namespace) -> int:
    write_corpus(args.out, config_from_args(args))
    return 0
