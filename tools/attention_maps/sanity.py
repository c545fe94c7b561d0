"""`mmtrain-attn --sanity`: the model-randomisation check (Adebayo et al. 2018). Re-initialise the top
half of the decoder (its layers, final norm and LM head), recompute every method's maps of the same
words, then also re-initialise the vision encoder and recompute again; report the Spearman rank
correlation of each method's maps with the trained ones (mean over words). A map that barely changes
when the weights that produce the prediction are random (Spearman >= FLAG) shows the input, not the
model: it is flagged.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from scipy.stats import spearmanr

from mmtrain.evaluation.attribution import doc_attributions, heads_map

FLAG = 0.3
STAGES = ("decoder top half", "+ vision encoder")


@torch.no_grad()
def reinit_(module: torch.nn.Module, std: float, gen: torch.Generator) -> None:
    """Fresh weights: matrices Normal(0, std), norm scales 1, biases 0 (the shapes of an init)."""
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.fill_(1.0)


def randomised(model, seed: int = 0):
    """The two cascading randomisations of a copy of the model."""
    gen = torch.Generator().manual_seed(seed)
    std = model.cfg.decoder.init_std
    m = copy.deepcopy(model)
    layers = m.decoder.layers
    for layer in list(layers)[len(layers) // 2:]:
        reinit_(layer, std, gen)
    reinit_(m.decoder.norm, std, gen)
    if m.decoder.lm_head is not None:
        reinit_(m.decoder.lm_head, std, gen)
    yield STAGES[0], m
    reinit_(m.vision, std, gen)
    yield STAGES[1], m


def sanity(model, words, methods: list[str], heads: list[tuple[int, int]], seed: int = 0) -> dict:
    """{stage: {method: mean Spearman}} and the methods flagged at any stage (`heads`: the
    localisation heads the trained model's maps were picked with)."""
    out: dict = {"stages": {}, "flag_at": FLAG}
    for stage, m in randomised(model, seed):
        maps = _maps(m, words)
        for mp in maps:
            mp["heads"] = heads_map(mp["per_head"], heads)
        rho = {k: float(np.nanmean([_spearman(sw.maps[k], mp[k]) for sw, mp in zip(words, maps)]))
               for k in methods}
        out["stages"][stage] = rho
    out["flagged"] = sorted({k for r in out["stages"].values() for k, v in r.items() if v >= FLAG})
    return out


def _maps(model, words) -> list[dict]:
    """The words' maps under `model`, one attribution pass per document."""
    by_doc: dict[int, list] = {}
    for i, sw in enumerate(words):
        by_doc.setdefault(id(sw.inputs), []).append(i)
    out: list = [None] * len(words)
    for idx in by_doc.values():
        got = doc_attributions(model, words[idx[0]].inputs, [words[i].span for i in idx])
        for i, mp in zip(idx, got):
            out[i] = mp
    return out


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")  # a flat map has no order
    return float(spearmanr(a, b).statistic)
