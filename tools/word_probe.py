"""Which caption words does a checkpoint read from the pixels? Accuracy and NLL per word class.

For every val token whose target is a shapes-world attribute word (colour, shape, size, place,
motion) in a document with media, compare the model's prediction with the real media and with
the media blanked. A class whose accuracy does not drop when blanked is not read from pixels.

    python -m tools.word_probe --ckpt runs/tiny [--json]   (a run, checkpoint or export directory)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import torch

from mmtrain.data_pipelines.batch import TASK_NAMES
from mmtrain.data_pipelines.loader import build_loader
from mmtrain.data_pipelines.synth.world import COLOR_NAMES, MOTIONS, POSITIONS, SHAPES, SIZES
from mmtrain.errors import run_guarded
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


@torch.no_grad()
def probe(ckpt: str) -> dict:
    loaded = load_model(ckpt)
    print(checkpoint_line(ckpt, loaded.path), file=sys.stderr)
    cfg, tok, model = loaded.cfg, loaded.tokenizer, loaded.model
    cfg.data.num_workers = 0
    classes = word_ids(tok)
    lookup_V = torch.full((cfg.model.decoder.vocab_size,), -1)
    names = sorted(set(classes.values()))
    for i, c in classes.items():
        lookup_V[i] = names.index(c)
    acc = defaultdict(lambda: [0, 0, 0.0])  # (task, class, media) -> n, correct, nll
    for batch in build_loader(cfg.data, tok, "val"):
        labels_BS = batch.labels_BS.clamp(min=0)
        cls_BS = torch.where(batch.labels_BS >= 0, lookup_V[labels_BS], -1)
        keep_BS = (cls_BS >= 0) & (batch.task_BS > 0)
        for media, b in (("real", batch), ("blank", blank_media(batch))):
            logp_BSV = model(**b.model_inputs()).logits_BSV.float().log_softmax(-1)
            nll_BS = -logp_BSV.gather(-1, labels_BS[..., None])[..., 0]
            hit_BS = logp_BSV.argmax(-1) == batch.labels_BS
            for task, c, h, n in zip(batch.task_BS[keep_BS].tolist(), cls_BS[keep_BS].tolist(),
                                     hit_BS[keep_BS].tolist(), nll_BS[keep_BS].tolist()):
                s = acc[(TASK_NAMES[task], names[c], media)]
                s[0] += 1
                s[1] += int(h)
                s[2] += n
    return {
        f"{t}/{c}/{m}": {"n": n, "accuracy": k / n, "nll": nll / n}
        for (t, c, m), (n, k, nll) in sorted(acc.items())
    }


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
    print(f"{'task/class':<24}{'n':>6}{'acc real':>10}{'acc blank':>10}{'nll real':>10}{'nll blank':>10}")
    for key in sorted({k.rsplit('/', 1)[0] for k in result}):
        r, b = result[f"{key}/real"], result[f"{key}/blank"]
        print(f"{key:<24}{r['n']:>6}{r['accuracy']:>10.2f}{b['accuracy']:>10.2f}{r['nll']:>10.2f}{b['nll']:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
