"""`mmtrain data ...` verbs; each lives in its own module with add_arguments(parser) and run(args)."""

from __future__ import annotations

import argparse
import importlib

VERBS = {
    "synth": (".synth.cli", "write the built-in 'shapes world' corpus and its tokenizer"),
    "write": (".write", "write shards from a folder of media or a JSONL file"),
    "inspect": (".inspect", "count samples, bad samples, tokens and packing efficiency"),
    "tokenizer": (".train_tokenizer", "train a BPE tokenizer.json on the text of shards or JSONL files"),
    "config": (".init_config", "write a short run config for your shards over tiny/small/base/long"),
}


def add_commands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", required=True)
    for verb, (module_name, help_text) in VERBS.items():
        module = importlib.import_module(module_name, __package__)
        p = sub.add_parser(verb, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
