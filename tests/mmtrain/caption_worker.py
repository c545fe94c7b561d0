"""`python tests/mmtrain/caption_worker.py CONFIG OUT` (or under torchrun): the captioning eval of a
freshly built model (FSDP-sharded under torchrun), written per rank to OUT.rank<r>.json with the
models built while it ran and on which device (meta: no random init)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml


def main(config: str, out: str) -> None:
    from mmtrain.config import from_dict
    from mmtrain.data_pipelines.tokenizer import load_tokenizer
    from mmtrain.evaluation.captioning import CaptionEval, build_caption_set
    from mmtrain.inference import loading
    from mmtrain.loop.trainer import _fill_vocab
    from mmtrain.parallel.distributed import init_distributed, pick_device, shutdown
    from mmtrain.parallel.parallelize import build_model
    from mmtrain.run_config import RunConfig
    from mmtrain.state.train_state import seed_everything

    torch.set_num_threads(1)
    cfg = from_dict(RunConfig, yaml.safe_load(Path(config).read_text()), source=config)
    env = init_distributed(cfg.dist, cfg.train.device)
    device = pick_device(cfg.train.device, env)
    tok = load_tokenizer(cfg.data.tokenizer)
    _fill_vocab(cfg, tok.vocab_size)
    seed_everything(cfg.train.seed)
    raw_model, _ = build_model(cfg, env, device)

    built = []  # the device each model built from now on was created on

    class Counted(loading.MultimodalModel):
        def __init__(self, *a, **k):
            built.append(torch.empty(0).device.type)
            super().__init__(*a, **k)

    loading.MultimodalModel = Counted
    ev = CaptionEval(cfg.captions, cfg.data)
    ev.set = build_caption_set(cfg.data, cfg.captions)
    trainer = SimpleNamespace(raw_model=raw_model, device=device, cfg=cfg, tokenizer=tok, step=0, env=env,
                              autocast=contextlib.nullcontext, pipeline=None)
    res = ev._caption(trainer)
    Path(f"{out}.rank{env.rank}.json").write_text(json.dumps({"result": res.to_dict(), "built": built}))
    shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
