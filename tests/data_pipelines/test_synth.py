import argparse
import collections
import hashlib
import io
import json
import random
import re
from pathlib import Path

import decord
import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from mmtrain.data_pipelines.errors import DataError
from mmtrain.data_pipelines.synth import KINDS, SPLITS, SynthConfig, cli, render, world, write_corpus
from mmtrain.data_pipelines.tokenizer import load_tokenizer

_META = {"__key__", "__url__", "__local_path__"}
_POS_RE = re.compile(r"at the (top left|top right|bottom left|bottom right|top|bottom|left|right|center)\b")


def _hashes(root: Path) -> dict[str, str]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    seed = random.randrange(10_000)
    out = tmp_path_factory.mktemp("synth")
    return out, write_corpus(out, SynthConfig.small(seed=seed), log=None), seed


def _samples(out: Path, manifest: dict, split: str, kind: str) -> list[dict]:
    urls = [str(out / p) for p in manifest["shards"][split][kind]]
    return list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))


def _nearest_color(rgb) -> str:
    dists = [np.abs(np.asarray(c, float) - np.asarray(rgb, float)).sum() for _, c in world.COLORS]
    return world.COLOR_NAMES[int(np.argmin(dists))]


def _count(words: list[str], text: str) -> collections.Counter:
    return collections.Counter(w for w in re.findall(r"[a-z]+", text) if w in words)


def _check_mentions(text: str, objects: list[dict], with_position: bool = True) -> None:
    """The text names exactly the objects' colours, shapes and sizes (and positions)."""
    for attr, words in (("color", world.COLOR_NAMES), ("shape", world.SHAPES), ("size", world.SIZES)):
        assert _count(list(words), text) == collections.Counter(o[attr] for o in objects), (attr, text)
    if with_position:
        positions = collections.Counter(o["position"] for o in objects)
        assert collections.Counter(_POS_RE.findall(text)) == positions, text


def _check_box(box, w: int, h: int) -> None:
    x0, y0, x1, y1 = box
    assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h, box


def _check_image(png: bytes, objects: list[dict], w: int, h: int) -> None:
    img = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    assert img.shape == (h, w, 3)
    for o in objects:
        _check_box(o["box"], w, h)
        x0, y0, x1, y1 = o["box"]
        assert _nearest_color(img[(y0 + y1) // 2, (x0 + x1) // 2]) == o["color"], o


def test_same_seed_identical_bytes_any_workers(tmp_path, corpus):
    out, manifest, seed = corpus
    # Workers write shards in another order and in other processes: bytes must not change.
    write_corpus(tmp_path, SynthConfig.small(seed=seed, workers=2), log=None)
    assert _hashes(tmp_path) == _hashes(out)


def test_different_seed_different_bytes(tmp_path, corpus):
    out, _, seed = corpus
    write_corpus(tmp_path, SynthConfig.small(seed=seed + 1, n_video=0), log=None)
    a, b = _hashes(out), _hashes(tmp_path)
    assert all(a[k] != b[k] for k in b if k.endswith(".tar"))


def test_manifest_matches_files(corpus):
    out, manifest, seed = corpus
    assert json.loads((out / "manifest.json").read_text()) == manifest and manifest["seed"] == seed
    listed = {p for s in SPLITS for k in KINDS for p in manifest["shards"][s][k]}
    assert listed == {str(p.relative_to(out)) for p in out.glob("*/*.tar")}
    for s in SPLITS:
        for k in KINDS:
            assert len(_samples(out, manifest, s, k)) == manifest["counts"][s][k]
    assert load_tokenizer(out / "tokenizer.json").vocab_size == manifest["vocab_size"]


def test_image_samples(corpus):
    out, manifest, _ = corpus
    for s in _samples(out, manifest, "train", "image"):
        assert "." not in s["__key__"]
        meta = json.loads(s["json"])
        caption = s["txt"].decode("utf-8")
        assert meta["kind"] == "image" and meta["caption"] == caption
        _check_image(s["png"], meta["objects"], meta["width"], meta["height"])
        _check_mentions(caption, meta["objects"])


def _check_motion(o: dict) -> None:
    xs = [(b[0] + b[2]) / 2 for b in o["boxes"]]
    ys = [(b[1] + b[3]) / 2 for b in o["boxes"]]
    areas = [(b[2] - b[0]) * (b[3] - b[1]) for b in o["boxes"]]
    series, sign = {
        "moves left": (xs, -1), "moves right": (xs, 1), "moves up": (ys, -1),
        "moves down": (ys, 1), "grows": (areas, 1), "shrinks": (areas, -1),
    }[o["motion"]]  # fmt: skip
    steps = np.diff(series) * sign
    assert (steps >= 0).all() and steps.sum() > 0, o


def test_video_samples(corpus):
    out, manifest, _ = corpus
    samples = _samples(out, manifest, "train", "video")
    assert samples
    for s in samples:
        meta = json.loads(s["json"])
        vr = decord.VideoReader(io.BytesIO(s["mp4"]))
        frames = vr.get_batch(list(range(len(vr)))).asnumpy()
        assert frames.shape == (meta["frames"], meta["height"], meta["width"], 3)
        assert vr.get_avg_fps() == pytest.approx(meta["fps"])
        _check_mentions(s["txt"].decode("utf-8"), meta["objects"], with_position=False)
        for o in meta["objects"]:
            assert o["motion"] in s["txt"].decode() and len(o["boxes"]) == meta["frames"]
            for b in o["boxes"]:
                _check_box(b, meta["width"], meta["height"])
            _check_motion(o)
        if len(meta["objects"]) == 1:  # lossy video, no occluder: the colour survives at the centre
            (o,) = meta["objects"]
            for t in (0, meta["frames"] - 1):
                x0, y0, x1, y1 = o["boxes"][t]
                assert _nearest_color(frames[t, (y0 + y1) // 2, (x0 + x1) // 2]) == o["color"]


@pytest.mark.parametrize("codec", ["libx264", "mpeg4"])  # mpeg4: the fallback without libx264
def test_mp4_codecs_decode_with_decord(codec):
    rng = np.random.default_rng()
    objs = world.sample_video_objects(rng)
    video_THW3, boxes = render.render_video(objs, 64, 6, rng)
    vr = decord.VideoReader(io.BytesIO(render.encode_mp4(video_THW3, 6, codec)))
    frames = vr.get_batch(list(range(len(vr)))).asnumpy()
    assert frames.shape == video_THW3.shape
    assert np.abs(frames.astype(int) - video_THW3).mean() < 8  # lossy, but close


def test_interleaved_samples(corpus):
    out, manifest, _ = corpus
    for s in _samples(out, manifest, "train", "interleaved"):
        meta = json.loads(s["json"])
        segs = meta["segments"]
        images = [g["image"] for g in segs if "image" in g]
        assert images == [f"{i}.png" for i in range(len(images))] and 2 <= len(images) <= 4
        assert set(s) - _META - {"json"} == set(images)
        for i, g in enumerate(segs):
            if "image" in g:
                _check_image(s[g["image"]], g["objects"], meta["width"], meta["height"])
                _check_mentions(segs[i + 1]["text"], g["objects"])  # the caption follows its picture


def test_text_samples(corpus):
    out, manifest, _ = corpus
    samples = _samples(out, manifest, "train", "text")
    assert samples
    for s in samples:
        assert set(s) - _META == {"txt"} and s["txt"].decode("utf-8").strip()


def test_rewrite_removes_only_stale_shards(tmp_path):
    sizes = dict(n_video=1, n_interleaved=1, n_text=2, n_val=1, shard_size=10)
    write_corpus(tmp_path, SynthConfig.small(n_image=40, **sizes), log=None)
    (tmp_path / "train" / "notes.txt").write_text("mine")
    write_corpus(tmp_path, SynthConfig.small(n_image=15, **sizes), log=None)
    images = sorted(p.name for p in (tmp_path / "train").glob("image-*"))
    assert images == ["image-000000.tar", "image-000001.tar"]
    assert (tmp_path / "train" / "notes.txt").read_text() == "mine"


def test_bad_inputs_are_data_errors(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DataError, match="cannot create output directory"):
        write_corpus(blocker / "out", SynthConfig.small(), log=None)
    with pytest.raises(DataError, match="decord"):  # decord 0.6 cannot read 48 px wide clips
        write_corpus(tmp_path / "out", SynthConfig.small(video_size=48), log=None)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    for flag in ("--image-size", "--shard-size", "--frames", "--n-image"):
        with pytest.raises(DataError, match=flag.lstrip("-").replace("-", "_")):
            cli.config_from_args(parser.parse_args(["--out", str(tmp_path), "--small", flag, "-1"]))
    cfg = cli.config_from_args(parser.parse_args(["--out", "x", "--small", "--seed", "7"]))
    assert cfg == SynthConfig.small(seed=7)


def test_cli_run_writes_corpus(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path), "--small", "--n-image", "5", "--n-video", "2"])
    assert cli.run(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines] == list(SPLITS)
    assert json.loads((tmp_path / "manifest.json").read_text())["counts"]["train"]["image"] == 5


def test_interleaved_text_counts_up_to_the_largest_document():
    """9 images of 2 objects, all one colour: the intro and the closing count still have words."""
    rng = np.random.default_rng(0)
    scenes = [[world.Obj("circle", "red", "small", "top left"), world.Obj("square", "red", "large", "bottom")]
              for _ in range(9)]
    segs = world.interleaved_texts(rng, scenes)
    assert segs.count(None) == 9
    assert segs[-1] == "In total eighteen shapes were red."
