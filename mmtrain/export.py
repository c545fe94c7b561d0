"""`mmtrain export CKPT --out DIR`: consolidated weights for consumers outside training.

DIR gets `model.safetensors` (the full, unsharded model state dict), `config.yaml` (the resolved
run config) and `tokenizer.json` (when the checkpoint carries one). `load_for_inference(DIR)`
reads it back, as does the attention-map tool. CKPT is a checkpoint directory `RUN/step_<N>`
or a run directory (its newest checkpoint).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import yaml

from mmtrain.checkpoint import CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE, Checkpointer, load_for_inference
from mmtrain.errors import UserError


def resolve_checkpoint(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such checkpoint")
    latest = Checkpointer(path, keep_last=1).latest()
    return latest if latest is not None else path


def export(ckpt: str | Path, out: str | Path) -> Path:
    from safetensors.torch import save_file

    src, out = resolve_checkpoint(ckpt), Path(out)
    config, state, tokenizer = load_for_inference(src)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    save_file(tensors, out / WEIGHTS_FILE, metadata={"format": "pt", "source": str(src)})
    (out / CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / TOKENIZER_FILE)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="RUN/step_<N>, or a run directory (its newest checkpoint)")
    parser.add_argument("--out", required=True, help="directory for model.safetensors, config.yaml, "
                                                     "tokenizer.json")


def run(args: argparse.Namespace) -> int:
    out = export(args.checkpoint, args.out)
    print(f"exported {resolve_checkpoint(args.checkpoint)} -> {out}")
    return 0
