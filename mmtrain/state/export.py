"""`mmtrain export CKPT --out DIR`: consolidated weights for consumers outside training
(`--hf`: a Hugging Face transformers folder instead, mmtrain/inference/export_hf.py; docs/EXPORT.md).

DIR gets `model.safetensors` (the full, unsharded model state dict), `config.yaml` (the resolved
run config) and `tokenizer.json` (the checkpoint's copy, else the one `data.tokenizer` names, a
file or a directory holding it). `load_for_inference(DIR)` reads it back, as does the
attention-map tool. CKPT is a checkpoint directory `RUN/step_<N>` or a run directory (its newest
checkpoint that verifies). The export is written next to DIR and renamed into place (an existing
export is replaced only once the new one is whole); files are mode 0644.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import yaml

from mmtrain.errors import UserError
from mmtrain.parallel.distributed import DistEnv
from mmtrain.state.checkpoint import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    Checkpointer,
    load_for_inference,
    swap_in,
    tokenizer_file,
)
from mmtrain.state.layout import LAYOUT
from mmtrain.state.manifest import verify


def resolve_checkpoint(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such checkpoint")
    latest, skipped = Checkpointer(path, keep_last=1).newest_valid()
    for p, why in skipped:
        print(f"warning: skipped damaged checkpoint {p}: {why}", file=sys.stderr)
    if latest is not None:
        return latest
    why = verify(path, DistEnv()) if path.is_dir() and not (path / WEIGHTS_FILE).is_file() else None
    if why is not None:
        raise UserError(f"{path}: damaged checkpoint: {why}")
    return path


def export(ckpt: str | Path, out: str | Path) -> Path:
    from safetensors.torch import save_file

    src, out = resolve_checkpoint(ckpt), Path(out)
    config, state, tokenizer = load_for_inference(src)
    tokenizer = tokenizer or tokenizer_file((config.get("data") or {}).get("tokenizer"))
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / WEIGHTS_FILE).is_file())):
        raise UserError(f"--out {out}: exists and is not an export (refusing to replace it)")
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    meta = {"format": "pt", "source": str(src), "layout": str(LAYOUT)}  # state/layout.py
    save_file(tensors, tmp / WEIGHTS_FILE, metadata=meta)
    (tmp / CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    if tokenizer is not None:
        shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
    for f in tmp.iterdir():
        f.chmod(0o644)
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    tmp.chmod(0o755)
    swap_in(tmp, out)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="RUN/step_<N>, or a run directory (its newest checkpoint)")
    parser.add_argument("--out", required=True, help="directory for model.safetensors, config.yaml, "
                                                     "tokenizer.json")
    parser.add_argument("--hf", action="store_true",
                        help="a Hugging Face transformers folder (remote code, processor; docs/EXPORT.md)")
    parser.add_argument("--max-shard-mib", type=float, default=4096, help="--hf: safetensors shard size")
    parser.add_argument("--no-parity", action="store_true",
                        help="--hf: skip the parity check against mmtrain (it needs transformers)")


def run(args: argparse.Namespace) -> int:
    """mmtrain's own export (`--hf` goes to export_hf.run, which the CLI calls)."""
    out = export(args.checkpoint, args.out)
    print(f"exported {resolve_checkpoint(args.checkpoint)} -> {out}")
    return 0
