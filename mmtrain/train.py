"""`python -m mmtrain.train CONFIG [--set key=value ...]` (also `mmtrain train`, and under torchrun)."""

from __future__ import annotations

import argparse
import time

from mmtrain.config import load_config
from mmtrain.report import print_summary
from mmtrain.run_config import RunConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML, e.g. configs/tiny.yaml")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value by its dotted key, e.g. --set optim.lr=3e-4 (repeatable)",
    )
    parser.add_argument("--run-dir", help="shorthand for --set run_dir=DIR")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or table")


def run(args: argparse.Namespace) -> int:
    from mmtrain.trainer import Trainer  # heavy imports only once the config is known to parse

    overrides = list(args.overrides) + ([f"run_dir={args.run_dir}"] if args.run_dir else [])
    cfg = load_config(RunConfig, args.config, overrides)
    t0 = time.perf_counter()
    summary = Trainer(cfg, verbose=not args.quiet).fit()
    if not args.quiet:
        print_summary(summary, time.perf_counter() - t0)
    return 0


def main(argv: list[str] | None = None) -> int:
    from mmtrain.cli import run_guarded

    parser = argparse.ArgumentParser(prog="python -m mmtrain.train", description=__doc__)
    add_arguments(parser)
    return run_guarded(lambda: run(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
