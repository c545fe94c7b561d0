"""Which caption words does a checkpoint read from the pixels? Accuracy and NLL per word class.

For every val token whose target is a shapes-world attribute word (colour, shape, size, place,
motion) in a document with media, compare the model's prediction with its own media and with
other documents' real media (`evaluate.mismatch_media`, on the tokens of the documents that got a
foreign medium): in distribution, so a class whose accuracy does not drop when swapped is not read
from the pixels -- the verdict. Blanked media (grey, out of distribution: a model that reads nothing
still reacts to them) stay beside it, labelled, on every such token.

    python -m tools.word_probe --ckpt runs/tiny [--json]   (a run, checkpoint or export directory)

--json: {"<task>/<class>/<media>": {"n", "accuracy", "nll"}}, media one of own, swapped (the swapped
documents' tokens), real, blank (every token).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

from mmtrain.data_pipelines.batch import TASK_NAMES, PackedBatch
from mmtrain.data_pipelines.loader import build_loader
from mmtrain.data_pipelines.synth.world import COLOR_NAMES, MOTIONS, POSITIONS, SHAPES, SIZES
from mmtrain.errors import run_guarded
from mmtrain.evaluation.evaluate import mismatch_media
from mmtrain.inference.loading import checkpoint_line, load_model
from mmtrain.objectives.terms import blank_media

WORD_CLASSES = {
    "colour": COLOR_NAMES,
    "shape": SHAPES,
    "size": SIZES,
    "place": sorted({w for p in POSITIONS for w in p.split()}),
    # "left"/"right" also name motions ("moves left"); they count as place words.
    "motion": sorted({w for m in MOTIONS for w in m.split()} - {"moves", "left", "right"}),
}


def word_ids(tok) -> dict[int, str]:
    """Token id -> class, for words that are one token (with their leading space)."""
    out = {}
    for cls, words in WORD_CLASSES.items():
        for w in words:
            ids = tok.encode(" " + w)
            if len(ids) == 1:
                out[ids[0]] = cls
    return out


def probe(ckpt: str) -> dict:
    """The per-class table (see --json in the module doc) of a checkpoint on its val split."""
    loaded = load_model(ckpt)
    print(checkpoint_line(ckpt, loaded.path), file=sys.stderr)
    cfg, tok = loaded.cfg, loaded.tokenizer
    cfg.data.num_workers = 0
    batches = build_loader(cfg.data, tok, "val")
    return word_stats(loaded.model, batches, word_ids(tok), cfg.model.decoder.vocab_size)


@torch.no_grad()
def word_stats(model: nn.Module, batches: Iterable[PackedBatch], classes: dict[int, str], vocab: int) -> dict:
    """{"<task>/<class>/<media>": {"n", "accuracy", "nll"}} over `batches` (model in eval mode)."""
    names = sorted(set(classes.values()))
    lookup_V = torch.full((vocab,), -1)
    for i, c in classes.items():
        lookup_V[i] = names.index(c)
    acc = defaultdict(lambda: [0, 0, 0.0])  # (task, class, media) -> n, correct, nll
    for batch in batches:
        cls_BS = torch.where(batch.labels_BS >= 0, lookup_V[batch.labels_BS.clamp(min=0)], -1)
        keep_BS = (cls_BS >= 0) & (batch.task_BS > 0)
        mismatched, swapped_BS = mismatch_media(batch)
        for media, b, on_BS in (("real", batch, keep_BS), ("blank", blank_media(batch), keep_BS),
                                ("swapped", mismatched, keep_BS & swapped_BS)):
            if not on_BS.any():
                continue
            pred = _predict(model, b)
            _add(acc, media, [batch.task_BS, cls_BS, *pred], on_BS, names)
            if media == "real":
                _add(acc, "own", [batch.task_BS, cls_BS, *pred], keep_BS & swapped_BS, names)
    return {
        f"{t}/{c}/{m}": {"n": n, "accuracy": k / n, "nll": nll / n}
        for (t, c, m), (n, k, nll) in sorted(acc.items())
    }


def _predict(model: nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S) bool argmax == label, (B, S) float NLL of the label."""
    logp_BSV = model(**batch.model_inputs()).logits_BSV.float().log_softmax(-1)
    nll_BS = -logp_BSV.gather(-1, batch.labels_BS.clamp(min=0)[..., None])[..., 0]
    return logp_BSV.argmax(-1) == batch.labels_BS, nll_BS


def _add(acc: dict, media: str, per_token: list[torch.Tensor], on_BS: torch.Tensor, names: list[str]) -> None:
    """Count the `on_BS` tokens of (task, class, hit, nll) per-token (B, S) tensors under `media`."""
    for task, c, h, n in zip(*(t[on_BS].tolist() for t in per_token)):
        s = acc[(TASK_NAMES[task], names[c], media)]
        s[0] += 1
        s[1] += int(h)
        s[2] += n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="RUN/step_<N>, a run directory (its newest valid "
                                                 "checkpoint) or an `mmtrain export` directory")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    return run_guarded(lambda: _report(args))


def _report(args: argparse.Namespace) -> int:
    result = probe(args.ckpt)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print("own vs swap: the swapped documents' tokens with their own / other documents' media (the "
          "verdict);\nreal vs blank: every token, media grey (out of distribution)")
    print(f"{'task/class':<24}{'n swap':>7}{'acc own':>9}{'acc swap':>9}{'nll own':>9}{'nll swap':>9}"
          f"{'n':>7}{'acc real':>9}{'acc blank':>10}{'nll real':>9}{'nll blank':>10}")
    for key in sorted({k.rsplit('/', 1)[0] for k in result}):
        o, w, r, b = (result.get(f"{key}/{m}") for m in ("own", "swapped", "real", "blank"))
        swap = (f"{o['n']:>7}{o['accuracy']:>9.2f}{w['accuracy']:>9.2f}{o['nll']:>9.2f}{w['nll']:>9.2f}"
                if o else f"{0:>7}" + f"{'-':>9}" * 4)
        print(f"{key:<24}{swap}{r['n']:>7}{r['accuracy']:>9.2f}{b['accuracy']:>10.2f}{r['nll']:>9.2f}"
              f"{b['nll']:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
