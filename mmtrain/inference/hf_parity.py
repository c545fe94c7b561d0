"""The parity figures `mmtrain export --hf` measures and writes into the model card: the exported
folder loaded by transformers against mmtrain's own model on the same prompts (a random image
with a caption start, a text), fp32 on CPU: the largest logit difference over every real
position (eager and sdpa attention, the prompts batched with left padding) and whether greedy
`generate` through transformers' cache gives mmtrain's tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mmtrain.data_pipelines.batch import IMAGE
from mmtrain.data_pipelines.packing import assemble
from mmtrain.data_pipelines.preprocess import Decoded
from mmtrain.inference.generate import generate, load
from mmtrain.inference.prompts import Prompt, prompt_document
from mmtrain.models.inference import SamplingConfig

NEW_TOKENS = 16


def measure(src: Path, folder: Path) -> dict | None:
    """None when transformers is not installed (the card then says the figures are unmeasured)."""
    try:
        import transformers
        from transformers import AutoModelForImageTextToText, AutoProcessor
    except ImportError:
        return None
    m = load(str(src), "cpu")
    h, w = m.cfg.data.media.factor * 3, m.cfg.data.media.factor * 4
    image = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    prompts = [
        Prompt("image", "image", [Decoded(IMAGE, image[None])], " a"),
        Prompt("text", "text", [], "a small"),
    ]
    proc = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    inputs = proc(images=[image], text=["<|image_pad|> a", "a small"], return_tensors="pt")
    docs = [prompt_document(p, m.tokenizer, m.cfg.data) for p in prompts]
    batch = assemble(
        [[d] for d in docs], max(len(d) for d in docs), m.tokenizer.special.pad, m.cfg.model.vision.patch_dim
    )
    with torch.no_grad():
        ref_BSV = m.model(**batch.model_inputs()).logits_BSV
    figures = {
        "transformers": transformers.__version__,
        "dtype": "float32",
        "device": "cpu",
        "prompts": "a random image + ' a', and 'a small' (batched, left-padded)",
        "new_tokens": NEW_TOKENS,
    }
    for impl in ("eager", "sdpa"):
        hf = AutoModelForImageTextToText.from_pretrained(
            folder, trust_remote_code=True, dtype=torch.float32, attn_implementation=impl
        ).eval()
        with torch.no_grad():
            logits_BSV = hf(**inputs).logits
        diff = max(
            (logits_BSV[b, -len(d) :] - ref_BSV[b, : len(d)]).abs().max().item() for b, d in enumerate(docs)
        )
        figures[f"max_abs_logit_diff_{impl}"] = diff
    ref = generate(m, prompts, SamplingConfig(max_new_tokens=NEW_TOKENS))
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    new = proc.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    figures["greedy_text_equal"] = all(g.text == t for g, t in zip(ref.generations, new))
    return figures
