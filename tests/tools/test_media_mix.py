"""configs/video_heavy.yaml on its corpus (scaled down, same synth sizes): at least 40% of the media
tokens are video and patch counts per medium spread at least 8x, on real loader batches."""

from __future__ import annotations

from pathlib import Path

import yaml

from mmtrain.config import apply_override, from_dict, read_raw
from mmtrain.data_pipelines.synth.config import SynthConfig
from mmtrain.data_pipelines.synth.writer import write_corpus
from mmtrain.run_config import RunConfig
from tools.bench.media_mix import main, media_mix

REPO = Path(__file__).resolve().parents[2]


def _config(corpus: Path, name: str) -> RunConfig:
    raw = read_raw(REPO / "configs" / name)
    raw["data"]["tokenizer"] = str(corpus / "tokenizer.json")
    for split in ("train", "val"):
        for src in raw["data"][split]:
            src["shards"] = [str(corpus / split / f"{src['name']}-*.tar")]
    for item in ["data.num_workers=0", "data.shuffle_buffer=8"]:
        apply_override(raw, item)
    return from_dict(RunConfig, raw, source=name)


def test_video_heavy_has_the_video_share_and_spread_it_promises(tmp_path):
    corpus = tmp_path / "shapes_video"  # Makefile data-video's sizes, fewer samples
    write_corpus(corpus, SynthConfig.small(image_size=32, video_size=64, frames=16, n_image=24, n_video=24,
                                           n_interleaved=8, n_text=16, shard_size=8), log=None)
    r = media_mix(_config(corpus, "video_heavy.yaml"), 12)
    assert r["video_share"] >= 0.4 and r["spread"] >= 8, r
    tiny = media_mix(_config(corpus, "tiny.yaml"), 12)  # the same corpus under tiny's 8-frame cap
    assert tiny["max_patches"] < r["max_patches"]


def test_cli_exits_1_when_a_bound_is_not_met(tmp_path, capsys):
    corpus = tmp_path / "shapes"
    small = SynthConfig.small(n_image=8, n_video=4, n_interleaved=2, n_text=4, shard_size=8)
    write_corpus(corpus, small, log=None)
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    sets = [f"data.tokenizer={corpus / 'tokenizer.json'}", "data.num_workers=0", "data.shuffle_buffer=8"]
    sets += [f"data.{s}.{i}.shards=[{corpus / s / src['name']}-*.tar]"
             for s in ("train", "val") for i, src in enumerate(raw["data"][s])]
    argv = ["--config", "configs/tiny.yaml", "--batches", "3", *[x for s in sets for x in ("--set", s)]]
    assert main([*argv, "--min-spread", "1"]) == 0
    assert main([*argv, "--min-spread", "100"]) == 1  # same-size images and clips: no 100x spread
    assert "media tokens" in capsys.readouterr().out
