"""`mmtrain data config`: a short config over a recipe, whose sources cover every shard once."""

import argparse
from pathlib import Path

import pytest
import yaml
from braceexpand import braceexpand
from dp_shards import mixed_samples, text_shards, video_bytes, write_tar

from mmtrain.data_pipelines import init_config
from mmtrain.data_pipelines.errors import DataError
from mmtrain.data_pipelines.scan import compact
from mmtrain.data_pipelines.shards import expand_spec

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def _run(*argv) -> dict:
    p = argparse.ArgumentParser()
    init_config.add_arguments(p)
    args = p.parse_args([*argv, "--base", TINY])
    assert init_config.run(args) == 0
    return yaml.safe_load(Path(args.out).read_text())


def _urls(specs: list[str]) -> list[str]:
    return [u for s in specs for u in expand_spec(s)]


def test_compact_names_the_same_shards():
    urls = [f"d/s-{i:06d}.tar" for i in (0, 1, 2, 5, 6)] + ["d/odd.tar", "d/s-07.tar", "d/s-08.tar"]
    specs = compact(urls)
    assert [u for s in specs for u in braceexpand(s)] == urls and len(specs) == 4


def test_held_out_val_and_train_cover_every_shard_once(tmp_path):
    texts = text_shards(tmp_path / "t", 3, 4)
    for n in range(2):
        clips = [{"__key__": f"c{i}", "mp4": video_bytes(4, fps=4), "txt": "moves"} for i in range(2 - n)]
        write_tar(tmp_path / "v" / f"clip-{n:06d}.tar", clips)
    raw = _run(f"{tmp_path}/t/*.tar", f"clips={tmp_path}/v", "--tokenizer", "byte",
               "--out", str(tmp_path / "cfg" / "my.yaml"))
    train, val = raw["data"]["train"], raw["data"]["val"]
    assert [s["name"] for s in train] == ["text", "clips"] == [s["name"] for s in val]
    for t, v, urls in zip(train, val, (texts, sorted(map(str, (tmp_path / "v").glob("*.tar"))))):
        assert sorted(_urls(t["shards"]) + _urls(v["shards"])) == sorted(urls)
        assert not set(_urls(t["shards"])) & set(_urls(v["shards"]))
    assert raw["data"]["media"] == {"video_fps": 4.0}  # tiny samples 8 fps; the clips have 4
    assert Path(tmp_path / "cfg" / raw["base"]).resolve() == Path(TINY).resolve()


def test_given_val_and_mixed_sources(tmp_path):
    write_tar(tmp_path / "m.tar", mixed_samples(8))
    text_shards(tmp_path / "val", 1, 2)
    raw = _run(str(tmp_path / "m.tar"), "--val", str(tmp_path / "val"), "--tokenizer", "tok.json",
               "--out", str(tmp_path / "my.yaml"))
    assert raw["data"]["train"] == [{"name": "mixed", "shards": [str(tmp_path / "m.tar")], "weight": 1.0}]
    assert raw["data"]["val"] == [{"name": "text", "shards": [str(tmp_path / "val")]}]
    assert raw["data"]["tokenizer"] == "tok.json" and raw["run_dir"] == "runs/my"


def test_bad_requests_are_one_line_errors(tmp_path):
    one = text_shards(tmp_path, 1, 2)[0]
    with pytest.raises(DataError, match="nothing left to train on"):
        _run(one, "--tokenizer", "byte", "--out", str(tmp_path / "a.yaml"))
    (tmp_path / "mine.yaml").write_text("edited")
    with pytest.raises(DataError, match="exists"):
        _run(one, "--tokenizer", "byte", "--out", str(tmp_path / "mine.yaml"))
    with pytest.raises(DataError, match="matches nothing"):
        _run(str(tmp_path / "none-*.tar"), "--out", str(tmp_path / "a.yaml"))
    p = argparse.ArgumentParser()
    init_config.add_arguments(p)
    with pytest.raises(DataError, match="--base huge"):
        init_config.run(p.parse_args([one, "--base", "huge", "--out", str(tmp_path / "a.yaml")]))
