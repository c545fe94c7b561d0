"""The vision balance's benchmarks in their smallest modes, so that they cannot rot: the arithmetic
(bench_vision_balance --quick), the cost fit (fit_vision_cost --quick) and the measured one
(bench_vision_ranks --quick, each part, 2 gloo ranks) on a scaled-down video_heavy corpus."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import yaml

from mmtrain.config import load_config
from mmtrain.data_pipelines.synth.config import SynthConfig
from mmtrain.data_pipelines.synth.writer import write_corpus
from mmtrain.run_config import RunConfig
from tools.bench import bench_vision_balance, bench_vision_ranks, fit_vision_cost

REPO = Path(__file__).resolve().parents[2]
SMALL_MODEL = ["model.vision.dim=32", "model.vision.depth=1", "model.vision.n_heads=2",
               "model.decoder.dim=32", "model.decoder.n_layers=2", "model.decoder.n_heads=2",
               "model.decoder.n_kv_heads=1", "model.decoder.ffn_dim=64",
               "model.decoder.mrope_sections=[2, 3, 3]",
               "model.decoder.moe.n_routed=4", "model.decoder.moe.expert_dim=32", "data.batch_size=2",
               "data.seq_len=192", "data.num_workers=0", "data.shuffle_buffer=8"]


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> list[str]:
    """--set items pointing configs/video_heavy.yaml at a small corpus of its sizes, model scaled down."""
    corpus = tmp_path_factory.mktemp("shapes_video")
    write_corpus(corpus, SynthConfig.small(image_size=32, video_size=64, frames=16, n_image=16, n_video=16,
                                           n_interleaved=8, n_text=8, shard_size=8), log=None)
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    out = [f"data.tokenizer={corpus / 'tokenizer.json'}"]
    for split in ("train", "val"):
        srcs = [{**s, "shards": [str(corpus / split / f"{s['name']}-*.tar")]} for s in raw["data"][split]]
        out.append(f"data.{split}={json.dumps(srcs)}")
    return out + SMALL_MODEL


def _argv(sets: list[str]) -> list[str]:
    return ["--config", str(REPO / "configs" / "video_heavy.yaml"), *[a for s in sets for a in ("--set", s)]]


def _rows(out: str) -> list[list[float]]:
    """The numeric rows of a printed table."""
    return [[float(x) for x in line.split() if re.fullmatch(r"[\d.]+", x)]
            for line in out.splitlines() if re.match(r"\s*\d+\s", line)]


def test_arithmetic_quick_balances(sets, capsys):
    for cp in ("1", "2"):
        bench_vision_balance.main([*_argv(sets), "--quick", "--cp", cp])
        (row,) = _rows(capsys.readouterr().out)
        assert row[0] == 8 and 1.0 <= row[-2] <= row[1], row  # dp(_cp) max/mean <= none's


def test_fit_quick_prints_the_overrides(capsys):
    fit_vision_cost.main(["--quick", "--config", str(REPO / "configs" / "tiny.yaml")])
    assert re.search(r"--set vision.cost_a=\S+ --set vision.cost_b=\S+ --set vision.cost_c=\S+",
                     capsys.readouterr().out)


@pytest.mark.distributed
def test_measured_quick_encoder_and_memory(sets, capsys, warm_subprocess):
    args = [*_argv(sets), "--quick", "--steps", "1", "--timeout", "400"]
    bench_vision_ranks.main([*args, "--part", "encoder", "--ranks", "2"])
    bench_vision_ranks.main([*args, "--part", "memory", "--cp", "2"])
    enc, mem = _rows(capsys.readouterr().out)
    assert enc[0] == 2 and min(enc[1:]) > 0
    assert mem[0] == 2 and 0 < mem[2] < mem[1]  # dp_cp: each medium once in the group, less per rank


def test_measured_step_overrides_load(sets, tmp_path):
    """The step part's runs (slow: two torchrun trainings, below) parse as configs."""
    args = argparse.Namespace(warmup=1, steps=1, set=sets)
    for balance in ("none", "dp"):
        load_config(RunConfig, REPO / "configs" / "video_heavy.yaml",
                    bench_vision_ranks.train_sets(args, balance, tmp_path / balance))


@pytest.mark.slow  # two 2-rank trainings (~1 min)
@pytest.mark.distributed
def test_measured_quick_step(sets, capsys):
    bench_vision_ranks.main([*_argv(sets), "--quick", "--timeout", "400", "--part", "step", "--ranks", "2",
                             "--steps", "1"])
    none, dp = _rows(capsys.readouterr().out)
    assert none[0] == dp[0] == 2 and none[1] > 0 and dp[1] > 0
