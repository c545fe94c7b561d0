"""Load a model for inference (generation, attention maps): config, weights and tokenizer.

`load_model(path)` takes a checkpoint directory `RUN/step_<N>`, a run directory (its newest
checkpoint that verifies against its manifest) or an `mmtrain export` directory, through
`checkpoint.load_for_inference`; no optimizer, data loader or process group is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mmtrain.config import from_dict
from mmtrain.data_pipelines.tokenizer import Tokenizer, load_tokenizer
from mmtrain.errors import UserError
from mmtrain.models.multimodal import ModelConfig, MultimodalModel
from mmtrain.run_config import RunConfig
from mmtrain.state.checkpoint import load_for_inference
from mmtrain.state.export import resolve_checkpoint

Tensor = torch.Tensor
_PREFIXES = ("_orig_mod.", "module.")  # torch.compile / DDP wrappers


@dataclass
class Loaded:
    path: Path
    cfg: RunConfig
    model: MultimodalModel
    tokenizer: Tokenizer
    device: torch.device


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available")
    return torch.device(device)


def _tokenizer_spec(path: Path, tok_file: Path | None, spec: str) -> str | Path:
    """The checkpoint's own tokenizer copy, else the config's (relative to the working directory,
    or to the checkpoint and the directories above it)."""
    if tok_file is not None:
        return tok_file
    if spec == "byte" or Path(spec).exists() or Path(spec).is_absolute():
        return spec
    base = path.resolve() if path.is_dir() else path.resolve().parent
    for d in [base, *base.parents][:4]:
        if (d / spec).exists():
            return d / spec
    raise UserError(f"{path}: checkpoint has no tokenizer.json and its config's tokenizer {spec} "
                    "was not found (run from the directory the run was trained in)")


def _clean_key(k: str) -> str:
    for p in _PREFIXES:
        k = k.replace(p, "")
    return k


def clean_state_dict(state: dict) -> dict:
    """Without torch.compile / DDP prefixes, DTensor shards gathered (collective under FSDP)."""
    # a DTensor from a sharded save
    return {_clean_key(k): v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}


def checkpoint_line(asked: str | Path, used: Path) -> str:
    """What a command prints about the checkpoint it loaded (a run directory names its pick)."""
    asked = Path(asked)
    return f"checkpoint: {used}" + ("" if used == asked else f" (newest valid in {asked})")


def load_model(path: str | Path, device: str = "cpu") -> Loaded:
    """Checkpoint, run or export directory -> model in eval mode on `device`, its run config and
    tokenizer."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"--ckpt {path}: no such checkpoint")
    path = resolve_checkpoint(path)
    cfg_dict, state, tok_file = load_for_inference(path)
    cfg = from_dict(RunConfig, cfg_dict, source=str(path))
    tok = load_tokenizer(_tokenizer_spec(path, tok_file, cfg.data.tokenizer))
    dec = cfg.model.decoder
    if dec.vocab_size is None:
        dec.vocab_size = tok.vocab_size
    if dec.vocab_size < tok.vocab_size:
        raise UserError(f"{path}: model vocabulary {dec.vocab_size} < tokenizer's {tok.vocab_size}: "
                        "the tokenizer does not belong to this checkpoint")
    try:
        model = MultimodalModel(cfg.model)
        missing, unexpected = model.load_state_dict(clean_state_dict(state), strict=False)
    except (RuntimeError, ValueError) as e:  # shape mismatches
        first = str(e).strip().splitlines()
        raise UserError(f"{path}: weights do not match the checkpoint's config: "
                        f"{first[1].strip() if len(first) > 1 else first[0]}") from None
    if missing or unexpected:
        what = [f"{len(missing)} missing (e.g. {missing[0]})"] if missing else []
        what += [f"{len(unexpected)} unexpected (e.g. {unexpected[0]})"] if unexpected else []
        raise UserError(f"{path}: weights do not match the checkpoint's config: {', '.join(what)} keys")
    dev = resolve_device(device)
    return Loaded(path, cfg, model.to(dev).eval(), tok, dev)


def is_sharded(model: nn.Module) -> bool:
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def gather_full_state(model: nn.Module, keep: bool) -> dict[str, Tensor] | None:
    """Parameters and buffers (persistent or not) with DTensor shards gathered one tensor at a time.

    Collective: every rank calls it and gathers in the same order; only a rank with `keep` holds
    the result, so the others' peak is one full tensor, not a model.
    """
    out = {}
    for k, v in [*model.state_dict().items(), *model.named_buffers()]:
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        if keep:
            out[_clean_key(k)] = full.detach()
    return out if keep else None


def replica_from_state(cfg: ModelConfig, state: dict[str, Tensor], device: torch.device) -> MultimodalModel:
    """A plain model holding `state`, built on the meta device: no random initialisation (minutes
    and a full extra copy at `base`), no RNG drawn. Every parameter and buffer must be in `state`."""
    with torch.device("meta"):
        replica = MultimodalModel(cfg)
    replica.to_empty(device=device)
    names = {k for k, _ in replica.named_parameters()} | {k for k, _ in replica.named_buffers()}
    if names - state.keys():
        raise ValueError(f"replica: no value for {sorted(names - state.keys())[:3]}")
    with torch.no_grad():
        for k, t in [*replica.named_parameters(), *replica.named_buffers()]:
            t.copy_(state[k])
    return replica


def local_replica(raw_model: MultimodalModel, device: torch.device, keep: bool = True
                  ) -> MultimodalModel | None:
    """`raw_model` itself, or when FSDP shards it an unsharded copy on `device` for the ranks with
    `keep` (None on the others). Every rank must call this: gathering the shards is collective."""
    if not is_sharded(raw_model):
        return raw_model
    state = gather_full_state(raw_model, keep)
    return replica_from_state(raw_model.cfg, state, device) if keep else None
