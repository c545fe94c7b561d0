"""`mmtrain` command line: `train`, `export`, `generate`, `plan`, `data synth|write|inspect`, `attn`
(= `mmtrain-attn`).

User mistakes (bad config, missing data, unwritable paths) print one line and exit 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from mmtrain.errors import run_guarded


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """only="plan": the plan subcommand alone, without importing the trainer, data and inference
    modules (~1.5 s of imports the plan does not use)."""
    parser = argparse.ArgumentParser(prog="mmtrain", description="joint text + image + video pretraining")
    sub = parser.add_subparsers(dest="command", required=True)
    if only == "plan":
        _add_plan(sub)
        return parser
    from mmtrain import train
    from mmtrain.data_pipelines import cli as data_cli
    from mmtrain.inference import export_hf, generate
    from mmtrain.state import export

    p_train = sub.add_parser("train", help="train a run config (resumes from RUN_DIR's latest checkpoint)")
    train.add_arguments(p_train)
    p_train.set_defaults(func=lambda a: train.reported(lambda: train.run(a)))  # a failure: its collectives
    p_export = sub.add_parser("export", help="consolidated weights (safetensors + config + tokenizer) "
                                             "of a checkpoint; --hf: a Hugging Face transformers folder")
    export.add_arguments(p_export)
    p_export.set_defaults(func=export_hf.run)  # --hf, else export.run
    p_gen = sub.add_parser("generate", help="captions and continuations from a checkpoint (KV cache)")
    generate.add_arguments(p_gen)
    p_gen.set_defaults(func=generate.run)
    _add_plan(sub)
    p_data = sub.add_parser("data", help="write, synthesise and inspect webdataset shards")
    data_cli.add_commands(p_data)
    from mmtrain.attention_maps import cli as attn_cli  # tools -> mmtrain: imported only here, argparse only

    p_attn = sub.add_parser("attn", help="attention maps: where text tokens look in images and video")
    attn_cli.add_arguments(p_attn)
    p_attn.set_defaults(func=attn_cli.run)
    return parser


def _add_plan(sub) -> None:
    from mmtrain.plan import cli as plan_cli

    p_plan = sub.add_parser("plan", help="before launch: memory per rank, collectives, FLOPs and a roofline "
                                         "step time of a config at N GPUs (fake tensors, seconds)")
    plan_cli.add_arguments(p_plan)
    p_plan.set_defaults(func=plan_cli.run)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(only="plan" if argv[:1] == ["plan"] else None)
    args = parser.parse_args(argv)
    code = run_guarded(lambda: args.func(args))
    if args.command == "train":
        from mmtrain.train import finish

        return finish(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
