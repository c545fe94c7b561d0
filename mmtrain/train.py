"""`python -m mmtrain.train CONFIG [--set key=value ...]` (also `mmtrain train`, and under torchrun:
`torchrun --nproc-per-node 8 -m mmtrain.train CONFIG`; see docs/DISTRIBUTED.md)."""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext

from mmtrain.config import load_config
from mmtrain.evaluation.report import print_summary
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
    # heavy imports only once the config is known to parse
    from mmtrain.loop.trainer import Trainer
    from mmtrain.parallel.distributed import init_distributed, shutdown
    from mmtrain.state.run_dir import undone_on_error

    overrides = list(args.overrides) + ([f"run_dir={args.run_dir}"] if args.run_dir else [])
    cfg = load_config(RunConfig, args.config, overrides)
    t0 = time.perf_counter()
    env = init_distributed(cfg.dist, cfg.train.device)
    # On an error the process just exits (non-zero): torchrun then stops the other ranks, which
    # may be blocked in a collective that this rank will never join.
    with undone_on_error(cfg.run_dir) if env.is_main else nullcontext():  # no empty run dir left
        trainer = Trainer(cfg, verbose=not args.quiet, env=env)
    summary = trainer.fit()
    shutdown()
    if not args.quiet and env.is_main:
        print_summary(summary, time.perf_counter() - t0)
        print(perf_line(summary))
    return 0


def perf_line(summary: dict) -> str:
    mfu = summary.get("mfu")
    return (f"throughput {summary['tokens_per_s_per_device']:,.0f} tokens/s per device "
            f"x {summary['world_size']} device(s); MFU {'n/a' if mfu is None else f'{mfu:.1%}'}; "
            f"peak memory {summary['peak_mem_gib']:.2f} GiB")


def finish(code: int) -> int:
    """The exit code of `train`; a torchrun worker (WORLD_SIZE > 1) exits right here instead (see
    mmtrain.parallel.distributed.exit_now: interpreter teardown can crash after gloo was used)."""
    from mmtrain.parallel.distributed import env_from_torchrun, exit_now

    if env_from_torchrun().distributed:
        exit_now(code)
    return code


def main(argv: list[str] | None = None) -> int:
    from mmtrain.errors import run_guarded

    parser = argparse.ArgumentParser(prog="python -m mmtrain.train", description=__doc__)
    add_arguments(parser)
    return finish(run_guarded(lambda: reported(lambda: run(parser.parse_args(argv)))))


def reported(fn):
    """fn(); when it raises (not a user error) after collectives were made, the last ones this rank
    entered go to stderr first: where the ranks' numbers part, they parted."""
    from mmtrain.errors import UserError
    from mmtrain.parallel import calls

    try:
        return fn()
    except Exception as e:
        if calls.recent() and not isinstance(e, UserError):
            print(calls.report(), file=sys.stderr, flush=True)
        raise


if __name__ == "__main__":
    raise SystemExit(main())
