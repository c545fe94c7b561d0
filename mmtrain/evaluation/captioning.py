"""Captioning eval: greedy captions of a fixed set of val images and videos, scored on the attribute
words their key.json records (colour, shape, size, place, motion), with the real media and with
every medium blanked; the difference is the *generation reliance gap* (near zero: the captions do
not come from the pixels).

Scoring: the attribute words of a caption are read in order (one pattern over every attribute value
the scanned key.json files name, longest first, so "moves left" is a motion and "top left" one
place); the reference is the sample's own caption (else its objects in order), so an attribute the
corpus's captions never state (the start cell of a moving object) is not scored. Attribute a of
object i is a hit when the i-th a-word of the generated caption equals the reference's. Accuracy =
hits / reference words, over the whole set.

Corpora without such attributes: the eval is skipped with a note. Under torchrun every rank
captions its share of the prompts and the counts are all-reduced; when FSDP shards the model, rank 0
alone captions them all from a gathered replica (CaptionEval._caption says why).

Legend: A attributes.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mmtrain.callbacks import Callback
from mmtrain.data_pipelines.config import DataConfig
from mmtrain.data_pipelines.decode import IMAGE_EXTS, VIDEO_EXTS, decode_json
from mmtrain.data_pipelines.ledger import SkipSample
from mmtrain.evaluation.caption_config import CaptionEvalConfig as CaptionEvalConfig  # re-exported
from mmtrain.inference.prompts import Prompt, iter_val_samples, sample_prompt
from mmtrain.models.inference import SamplingConfig

if TYPE_CHECKING:
    from mmtrain.inference.loading import Loaded
    from mmtrain.loop.trainer import Trainer
    from mmtrain.parallel.distributed import DistEnv

# key.json field -> reported name
ATTRIBUTES = {"color": "colour", "shape": "shape", "size": "size", "position": "place", "motion": "motion"}


@dataclass
class CaptionSet:
    """The fixed prompts (media only) and what their captions should say."""

    prompts: list[Prompt] = field(default_factory=list)
    truths: list[dict[str, list[str]]] = field(default_factory=list)  # attribute -> words in order
    pattern: re.Pattern | None = None
    value_attr: dict[str, str] = field(default_factory=dict)  # attribute word -> attribute
    note: str | None = None  # why the eval is skipped


def _objects(meta) -> list[dict]:
    objs = meta.get("objects") if isinstance(meta, dict) else None
    return [o for o in objs if isinstance(o, dict)] if isinstance(objs, list) else []


def read_words(text: str, cs: CaptionSet) -> dict[str, list[str]]:
    """The attribute words of a caption, in order, per attribute."""
    out: dict[str, list[str]] = {}
    for m in cs.pattern.finditer(text.lower()):
        out.setdefault(cs.value_attr[m.group(0)], []).append(m.group(0))
    return out


def build_caption_set(data: DataConfig, cfg: CaptionEvalConfig) -> CaptionSet:
    """The first cfg.images images and cfg.videos videos of the val split with attributes; the attribute
    words of the first cfg.scan val samples' key.json files are the words captions are read for."""
    want = {"image": cfg.images, "video": cfg.videos}
    picked: list[tuple[Prompt, dict]] = []
    values: dict[str, str] = {}
    for n, (_, raw) in enumerate(iter_val_samples(data)):  # all `scan` samples: the words to read
        if n >= cfg.scan:
            break
        kind = "video" if any(e in raw.members for e in VIDEO_EXTS) else \
            "image" if any(e in raw.members for e in IMAGE_EXTS) else None
        try:
            meta = decode_json(raw.members["json"]) if "json" in raw.members else None
            objs = _objects(meta)
            for o in objs:
                values.update({str(o[a]).lower(): a for a in ATTRIBUTES if isinstance(o.get(a), str)})
            if kind is None or not want[kind] or not any(a in o for o in objs for a in ATTRIBUTES):
                continue
            picked.append((sample_prompt(raw, data.media), meta))
            want[kind] -= 1
        except (SkipSample, ValueError):
            continue  # a sample the loader would skip is not evaluated either
    if not picked:
        return CaptionSet(note="no val image or video sample has key.json attributes "
                               f"({', '.join(ATTRIBUTES)}): captioning eval skipped")
    words = sorted(values, key=len, reverse=True)
    pattern = re.compile(r"\b(?:" + "|".join(map(re.escape, words)) + r")\b")
    cs = CaptionSet(pattern=pattern, value_attr=values)
    for p, meta in picked:
        ref = meta.get("caption") if isinstance(meta.get("caption"), str) else p.reference
        truth = read_words(ref, cs) if ref else \
            {a: [str(o[a]).lower() for o in _objects(meta) if a in o] for a in ATTRIBUTES}
        cs.prompts.append(p)
        cs.truths.append(truth)
    return cs


def score(text: str, truth: dict[str, list[str]], cs: CaptionSet) -> dict[str, tuple[int, int]]:
    """attribute -> (hits, reference words)."""
    got = read_words(text, cs)
    return {a: (sum(i < len(got.get(a, [])) and got[a][i] == w for i, w in enumerate(ws)), len(ws))
            for a, ws in truth.items()}


@dataclass
class CaptionResult:
    step: int
    accuracy: dict[str, float]  # reported attribute name -> accuracy with the real media
    blank_accuracy: dict[str, float]  # ... with every medium blanked
    words: dict[str, int]  # reference words scored per attribute
    prompts: int
    examples: list[dict]  # {"name", "caption", "reference"} of the first prompts (rank 0's share)

    @property
    def gap(self) -> dict[str, float]:
        return {a: self.accuracy[a] - self.blank_accuracy[a] for a in self.accuracy}

    def scalars(self, prefix: str = "caption") -> dict[str, float]:
        out = {f"{prefix}/acc_{a}": v for a, v in self.accuracy.items()}
        out.update({f"{prefix}/blank_acc_{a}": v for a, v in self.blank_accuracy.items()})
        out.update({f"{prefix}/gap_{a}": v for a, v in self.gap.items()})
        return out

    def to_dict(self) -> dict:
        return {"step": self.step, "accuracy": self.accuracy, "blank_accuracy": self.blank_accuracy,
                "gap": self.gap, "words": self.words, "prompts": self.prompts, "examples": self.examples}

    def line(self) -> str:
        blank = self.blank_accuracy
        return ", ".join(f"{a} {v:.0%} (blank {blank[a]:.0%})" for a, v in self.accuracy.items())


@torch.no_grad()
def run_captioning(m: Loaded, cs: CaptionSet, cfg: CaptionEvalConfig, step: int, env: DistEnv | None = None,
                   autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                   ) -> CaptionResult:
    """Caption this rank's share of cs greedily, with real and blank media; counts summed over ranks."""
    # Imported here: run_config imports this module for its config, and these import run_config.
    from mmtrain.inference.generate import generate
    from mmtrain.parallel.distributed import DistEnv, all_reduce

    env = env or DistEnv()
    mine = list(range(env.rank, len(cs.prompts), env.world_size))
    attrs = list(ATTRIBUTES)
    counts_3A = torch.zeros(3, len(attrs), dtype=torch.float64)  # hits real, hits blank, reference words
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens)
    examples = []
    for row, blank in enumerate((False, True)):
        with autocast():
            res = generate(m, [cs.prompts[i] for i in mine], sampling, batch_size=16, blank_media=blank)
        for i, g in zip(mine, res.generations):
            for a, (hits, n) in score(g.text, cs.truths[i], cs).items():
                counts_3A[row, attrs.index(a)] += hits
                counts_3A[2, attrs.index(a)] += n * (row == 0)
            if not blank and len(examples) < cfg.examples:
                examples.append({"name": g.name, "caption": g.text, "reference": g.reference})
    if env.distributed:
        counts_3A = all_reduce(counts_3A.to(m.device), env).cpu()
    real, blank_, n = counts_3A.tolist()
    keep = {ATTRIBUTES[a]: j for j, a in enumerate(attrs) if n[j] > 0}
    return CaptionResult(step, {a: real[j] / n[j] for a, j in keep.items()},
                         {a: blank_[j] / n[j] for a, j in keep.items()},
                         {a: int(n[j]) for a, j in keep.items()}, len(cs.prompts), examples)


class CaptionEval(Callback):
    """The trainer's callback, at every evaluation: builds the fixed set at its first call, captions in
    eval mode (module modes restored after; greedy decoding draws no random numbers), logs, and adds
    `captions` to the eval record (nothing when off or skipped)."""

    name = "captions"

    def __init__(self, cfg: CaptionEvalConfig, data: DataConfig) -> None:
        self.cfg, self.data = cfg, data
        self.set: CaptionSet | None = None

    def on_eval(self, trainer: Trainer, record: dict) -> None:
        if not (self.cfg.images or self.cfg.videos):
            return
        log, step = trainer.log, trainer.step
        if self.set is None:
            self.set = build_caption_set(self.data, self.cfg)
            if self.set.note:
                log.info(self.set.note)
        if self.set.note:
            return
        res = self._caption(trainer)
        log.scalars(step, res.scalars())
        log.record({"step": step, "eval": "captions", **res.to_dict()})
        log.info(f"captions @ {step}: {res.line()}")
        for ex in res.examples:
            log.info(f"  {ex['name']}: {ex['caption']!r} (reference {ex['reference']!r})")
        record["captions"] = res.to_dict()

    def _caption(self, trainer: Trainer) -> CaptionResult:
        """Unsharded: every rank captions its share from its own model, counts all-reduced.
        dist.pp > 1: rank 0 captions every prompt from its pipeline's replica (in host memory,
        streamed to the device: mmtrain/parallel/pipeline_replica.py); the others wait as below.
        FSDP-sharded: the shards are gathered to rank 0 alone, which captions every prompt from a
        replica built without a random init; the others wait in the broadcast of its result (so
        every rank runs the same collectives, and one rank, not all, holds a full copy). That wait
        must fit in dist.timeout_s."""
        from mmtrain.inference.loading import is_sharded, local_replica
        from mmtrain.parallel.distributed import broadcast_object

        env = trainer.env
        if trainer.pipeline is not None:  # the replica is on each pipeline's first rank: rank 0 captions
            res = self._run(trainer, trainer.raw_model, None) if env.is_main else None
            return broadcast_object(res, env)
        if not is_sharded(trainer.raw_model):
            return self._run(trainer, trainer.raw_model, env)
        replica = local_replica(trainer.raw_model, trainer.device, keep=env.is_main)
        res = self._run(trainer, replica, None) if env.is_main else None
        del replica
        return broadcast_object(res, env)

    def _run(self, trainer: Trainer, model, env: DistEnv | None) -> CaptionResult:
        from mmtrain.inference.loading import Loaded

        modes = [(mod, mod.training) for mod in model.modules()]
        model.eval()
        try:
            m = Loaded(None, trainer.cfg, model, trainer.tokenizer, trainer.device)
            return run_captioning(m, self.set, self.cfg, trainer.step, env, trainer.autocast)
        finally:
            for mod, mode in modes:
                mod.training = mode
