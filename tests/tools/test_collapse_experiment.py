"""The collapse experiment's smoke version: every shipped arm runs a few steps on a tiny corpus, the
table and plots come out, and a second invocation reuses the finished runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mmtrain.config import apply_override
from mmtrain.data_pipelines.synth.config import SynthConfig
from mmtrain.data_pipelines.synth.writer import write_corpus
from tools.experiments.collapse import DEFAULT, main

REPO = Path(__file__).resolve().parents[2]
SHRINK = ["data.media.max_pixels=2304", "model.vision.dim=32", "model.vision.depth=1",
          "model.vision.n_heads=2", "model.decoder.dim=32", "model.decoder.n_layers=2",
          "model.decoder.n_heads=2", "model.decoder.n_kv_heads=1", "model.decoder.ffn_dim=64",
          "model.decoder.mrope_sections=[2, 3, 3]", "model.decoder.moe.n_routed=4",
          "model.decoder.moe.expert_dim=32"]


def _experiment(tmp: Path, shipped_path: Path = DEFAULT) -> Path:
    """A shipped experiment, pointed at a tiny corpus with a tiny model (stages end at step 2)."""
    corpus = tmp / "shapes"
    write_corpus(corpus, SynthConfig.small(n_image=8, n_video=4, n_interleaved=4, n_text=8, n_val=2,
                                           shard_size=4))
    shipped = yaml.safe_load((REPO / shipped_path).read_text())
    base = yaml.safe_load((REPO / shipped_path).parent.joinpath(shipped["base"]).read_text())
    base["data"]["tokenizer"] = str(corpus / "tokenizer.json")
    for split in ("train", "val"):
        for src in base["data"][split]:
            src["shards"] = [str(corpus / split / f"{src['name']}-*.tar")]
    for item in SHRINK:
        apply_override(base, item)
    (tmp / "base.yaml").write_text(yaml.safe_dump(base))
    arms = {name: [o.replace("until_step: 250", "until_step: 2") for o in over]
            for name, over in shipped["arms"].items()}
    exp = {**shipped, "base": "base.yaml", "arms": arms}
    (tmp / "experiment.yaml").write_text(yaml.safe_dump(exp))
    return tmp / "experiment.yaml"


@pytest.mark.budget(40)  # 9 s measured (docs/CONVENTIONS.md)
def test_smoke_runs_every_arm_and_writes_the_table(tmp_path, capsys, warm_subprocess):
    exp = _experiment(tmp_path)
    out, report = tmp_path / "out", tmp_path / "report"
    args = ["--experiment", str(exp), "--out", str(out), "--smoke", "--seeds", "0", "--jobs", "2",
            "--report", str(report)]
    assert main(args) == 0
    shipped_arms = yaml.safe_load((REPO / DEFAULT).read_text())["arms"]
    results = json.loads((out / "results.json").read_text())
    assert set(results["arms"]) == set(shipped_arms)
    for arm, a in results["arms"].items():
        assert a["seeds"] == 1 and a["tokens"] > 0, arm
        assert all(a["loss"][t]["mean"] > 0 for t in ("text", "image_text", "video_text")), arm
        assert (out / arm / "seed0" / "diagnostics.jsonl").is_file()
    assert "curriculum stage 1" in (out / "staged" / "seed0" / "train.log").read_text()
    table = (out / "table.md").read_text()
    assert all(f"| {arm} |" in table for arm in shipped_arms)
    for name in ("table.md", "results.json", "final.png", "reliance_gap_image_text.png",
                 "reliance_gap_video_text.png"):
        assert (report / name).is_file(), name
    capsys.readouterr()
    assert main(args) == 0  # everything cached: nothing retrains
    assert "cached" in capsys.readouterr().out


def test_bad_arm_and_bad_override_fail_before_training(tmp_path, capsys):
    exp = _experiment(tmp_path)
    assert main(["--experiment", str(exp), "--out", str(tmp_path / "o"), "--arms", "nope"]) == 2
    assert "unknown arm 'nope'" in capsys.readouterr().err
    assert main(["--experiment", str(exp), "--out", str(tmp_path / "o"), "--set", "optim.lr=-1"]) == 2
    assert "optim.lr" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


MIXTURE = Path("configs/experiments/collapse/mixture.yaml")


@pytest.mark.budget(30)  # 6-11 s measured
def test_mixture_arms_run_and_a_matched_mix_comes_from_the_controller(tmp_path, capsys, warm_subprocess):
    """The preventing-collapse experiment's new arms (controller, token weighting, both) run with its
    common overrides; --matched prints the controller's average shares as a fixed mix."""
    exp = _experiment(tmp_path, MIXTURE)
    out = tmp_path / "out"
    arms = "controller,token_weighting,controller_tw"
    args = ["--experiment", str(exp), "--out", str(out), "--smoke", "--seeds", "0", "--arms", arms,
            "--attn", "2"]
    assert main(args) == 0
    summary = json.loads((out / "controller" / "seed0" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["mix"]["decisions"] >= 1  # smoke steps override common
    results = json.loads((out / "results.json").read_text())
    assert results["arms"]["controller"]["media_share"]["mean"] > 0
    assert results["arms"]["token_weighting"]["tw_s"]["mean"] > 0
    assert (out / "controller" / "seed0" / "attn" / "metrics.json").is_file()  # mmtrain-attn ran
    assert "pointing (mmtrain-attn)" in (out / "table.md").read_text()
    capsys.readouterr()
    assert main(["--experiment", str(exp), "--out", str(out), "--seeds", "0", "--matched", "controller"]) == 0
    printed = capsys.readouterr().out.split()
    weights = [float(item.split("=")[1]) for item in printed]
    assert [item.split("=")[0] for item in printed] == [f"data.train.{i}.weight" for i in range(4)]
    assert abs(sum(weights) - 1) < 1e-3 and weights[3] < 0.86 + 1e-3  # no more text than configured
    assert main(["--experiment", str(exp), "--out", str(out), "--seeds", "0", "--matched", "static"]) == 2
