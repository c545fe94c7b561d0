"""One webdataset sample of each kind: the members (name -> bytes) and its training texts.

Each sample has its own RNG, seeded from (seed, split, kind, index): a sample's content does
not depend on how many samples of other kinds, splits or shards are written.
"""

from __future__ import annotations

import json

import numpy as np

from mmtrain.data_pipelines.synth import render, world
from mmtrain.data_pipelines.synth.config import KINDS, SPLITS, SynthConfig

KEY_PREFIX = (("image", "img"), ("video", "vid"), ("interleaved", "doc"), ("text", "txt"))


def sample_rng(seed: int, split: str, kind: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, SPLITS.index(split), KINDS.index(kind), index])


def sample_key(kind: str, index: int) -> str:
    """Webdataset key: no dots (everything before the first dot of a member name is the key)."""
    return f"{dict(KEY_PREFIX)[kind]}_{index:08d}"


def _objects_json(objs: list[world.Obj], boxes: list) -> list[dict]:
    out = []
    for o, b in zip(objs, boxes):
        d = {"shape": o.shape, "color": o.color, "size": o.size, "position": o.position}
        if o.motion is None:
            d["box"] = b
        else:
            d["motion"], d["boxes"] = o.motion, b
        out.append(d)
    return out


def _dump(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")


def image_sample(rng: np.random.Generator, cfg: SynthConfig) -> tuple[dict[str, bytes], list[str]]:
    objs = world.sample_objects(rng)
    img_HW3, boxes = render.render_image(objs, cfg.image_size, rng)
    caption = world.image_caption(rng, objs)
    meta = {"kind": "image", "width": cfg.image_size, "height": cfg.image_size,
            "objects": _objects_json(objs, boxes), "caption": caption}  # fmt: skip
    return {"png": render.encode_png(img_HW3), "txt": caption.encode(), "json": _dump(meta)}, [caption]


def video_sample(rng: np.random.Generator, cfg: SynthConfig) -> tuple[dict[str, bytes], list[str]]:
    objs = world.sample_video_objects(rng)
    video_THW3, boxes = render.render_video(objs, cfg.video_size, cfg.frames, rng)
    caption = world.video_caption(rng, objs)
    meta = {"kind": "video", "width": cfg.video_size, "height": cfg.video_size, "fps": cfg.fps,
            "frames": cfg.frames, "objects": _objects_json(objs, boxes), "caption": caption}  # fmt: skip
    mp4 = render.encode_mp4(video_THW3, cfg.fps)
    return {"mp4": mp4, "txt": caption.encode(), "json": _dump(meta)}, [caption]


def interleaved_sample(rng: np.random.Generator, cfg: SynthConfig) -> tuple[dict[str, bytes], list[str]]:
    n = int(rng.integers(cfg.min_images, cfg.max_images + 1))
    scenes = [world.sample_objects(rng) for _ in range(n)]
    members: dict[str, bytes] = {}
    segments: list[dict] = []
    texts: list[str] = []
    i = 0
    for text in world.interleaved_texts(rng, scenes):
        if text is not None:
            segments.append({"text": text})
            texts.append(text)
            continue
        img_HW3, boxes = render.render_image(scenes[i], cfg.image_size, rng)
        members[f"{i}.png"] = render.encode_png(img_HW3)
        segments.append({"image": f"{i}.png", "objects": _objects_json(scenes[i], boxes)})
        i += 1
    meta = {"kind": "interleaved", "width": cfg.image_size, "height": cfg.image_size, "segments": segments}
    members["json"] = _dump(meta)
    # The tokenizer sees the document's text as the loader will: segments joined by spaces.
    return members, [" ".join(texts)]


def text_sample(rng: np.random.Generator, cfg: SynthConfig) -> tuple[dict[str, bytes], list[str]]:
    doc = world.text_document(rng)
    return {"txt": doc.encode()}, [doc]


Sample = tuple[str, dict[str, bytes], list[str]]  # (key, members by extension, training texts)


def make_sample(cfg: SynthConfig, split: str, kind: str, index: int) -> Sample:
    """Sample `index` of a split and kind."""
    build = {"image": image_sample, "video": video_sample, "interleaved": interleaved_sample,
             "text": text_sample}[kind]  # fmt: skip
    members, texts = build(sample_rng(cfg.seed, split, kind, index), cfg)
    return sample_key(kind, index), members, texts


def make_samples(cfg: SynthConfig, split: str, kind: str, start: int, stop: int) -> list[Sample]:
    """Samples start..stop-1 (one shard's worth; what a worker process computes)."""
    return [make_sample(cfg, split, kind, i) for i in range(start, stop)]
