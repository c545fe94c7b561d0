"""`mmtrain-attn` end to end on a tiny random checkpoint and a tiny built-in corpus: every output is
written and non-empty, metrics.json has what the issue asks for, and user mistakes are one line + exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from mmtrain import cli as mmtrain_cli
from mmtrain.attention_maps.cli import main
from mmtrain.config import apply_override, from_dict, to_dict
from mmtrain.data_pipelines.synth.config import SynthConfig
from mmtrain.data_pipelines.synth.writer import write_corpus
from mmtrain.models.multimodal import MultimodalModel
from mmtrain.run_config import RunConfig

REPO = Path(__file__).resolve().parents[2]


def _config(corpus: Path) -> RunConfig:
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    raw["data"]["tokenizer"] = str(corpus / "tokenizer.json")
    for split in ("train", "val"):
        for src in raw["data"][split]:
            src["shards"] = [str(corpus / split / f"{src['name']}-*.tar")]
    for item in ["data.num_workers=0", "data.seq_len=160", "data.media.max_pixels=2304",
                 "model.vision.dim=32", "model.vision.depth=1", "model.vision.n_heads=2",
                 "model.vision.abs_pos_grid=0", "model.decoder.dim=32", "model.decoder.n_layers=2",
                 "model.decoder.n_heads=2", "model.decoder.n_kv_heads=1", "model.decoder.ffn_dim=64",
                 "model.decoder.mrope_sections=[2, 3, 3]", "model.decoder.moe.n_routed=4",
                 "model.decoder.moe.expert_dim=32", "model.decoder.attention.block_size=8",
                 "model.decoder.attention.window=8", "model.decoder.attention.top_k=1"]:
        apply_override(raw, item)
    return from_dict(RunConfig, raw, source="attn-test")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("attn")
    corpus = root / "shapes"
    write_corpus(corpus, SynthConfig.small(n_image=6, n_video=2, n_interleaved=2, n_text=4, n_val=2,
                                           shard_size=8), log=None)
    cfg = _config(corpus)
    cfg.model.decoder.vocab_size = json.loads((corpus / "manifest.json").read_text())["vocab_size"]
    ckpt = root / "run" / "step_1"
    ckpt.mkdir(parents=True)
    torch.save({"model": MultimodalModel(cfg.model).state_dict(), "config": to_dict(cfg), "layout": 2},
               ckpt / "state.pt")
    image = root / "shapes.png"
    pixels = np.full((40, 56, 3), 30, np.uint8)
    pixels[8:20, 30:44] = (230, 40, 40)
    Image.fromarray(pixels).save(image)
    return {"root": root, "corpus": corpus, "ckpt": str(ckpt), "image": str(image), "cfg": cfg}


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    torch.set_num_threads(1)
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _outputs_ok(out: Path) -> dict:
    report = out / "report.html"
    assert report.is_file() and report.stat().st_size > 1000
    pngs = list(out.rglob("*.png"))
    assert pngs and all(p.stat().st_size > 100 for p in pngs)
    assert (out / "mass_grid.png") in pngs
    text = report.read_text()
    assert text.count("data:image/png;base64,") >= len(pngs) and "<script" not in text
    return json.loads((out / "metrics.json").read_text())


def test_image_with_boxes_and_all_heads(setup, tmp_path, capsys):
    out = tmp_path / "img"
    boxes = '[{"color": "red", "shape": "square", "box": [30, 8, 44, 20]}]'
    rc, stdout, err = _run(["--ckpt", setup["ckpt"], "--image", setup["image"],
                            "--text", "a large red square.", "--boxes", boxes,
                            "--layers", "0,-1", "--heads", "all", "--out", str(out)], capsys)
    assert rc == 0, err
    m = _outputs_ok(out)
    assert m["layers"] == [0, 1] and m["layer_kinds"] == {"0": "full", "1": "sparse"}
    mass = m["attention"]["mass"]["per_layer"]
    assert set(mass) == {"0", "1"} and all(0 <= v <= 1 for v in mass.values())
    assert len(m["attention"]["mass"]["per_layer_head"]["0"]) == 2
    assert {"entropy", "sink"} <= set(m["attention"])
    words = {t["word"]: t for t in m["pointing_game"]["token"]["per_token"]}
    assert set(words) == {"red", "square"}
    red = words["red"]
    assert red["chance"] == pytest.approx(14 * 12 / (40 * 56)) and 0 < red["chance_cell"] <= 1
    assert set(red["accuracy"]) == {"0", "1", "mean"}
    assert m["headline"]["colour"]["n"] == 1 and "chance" in m["headline"]["shape"]
    # Every text token after the image has a picture; "red" is linked from the token strip.
    assert len(list((out / "maps").glob("*_t*_*.png"))) == len(m["tokens"]) >= 4
    assert "pointing colour" in stdout
    assert stdout.splitlines()[0] == f"checkpoint: {setup['ckpt']}"


def test_video_sample_from_a_shard(setup, tmp_path, capsys):
    out = tmp_path / "vid"
    shard = setup["corpus"] / "val" / "video-000000.tar"
    rc, _, err = _run(["--ckpt", setup["ckpt"], "--shard", str(shard), "--key", "vid_00000000",
                       "--tokens", "a", "--query", "predictor", "--out", str(out)], capsys)
    assert rc == 0, err
    m = _outputs_ok(out)
    # 4 source frames at 4 fps, sampled at video_fps 8 -> 8 frames -> 4 temporal slices.
    assert m["input"]["kind"] == "video" and m["input"]["media"][0]["grid_thw"][0] == 4
    gifs = list((out / "maps").glob("*.gif"))
    assert gifs and all(g.stat().st_size > 100 for g in gifs)
    assert all(Image.open(g).n_frames == 4 for g in gifs)
    assert m["pointing_game"]["token"]["per_token"], "the caption names its objects"


def test_from_val_aggregate_and_mmtrain_subcommand(setup, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # val shard paths in the config are absolute
    out = tmp_path / "val"
    torch.set_num_threads(1)
    run_dir = Path(setup["ckpt"]).parent  # a run directory: its newest valid checkpoint is used
    rc = mmtrain_cli.main(["attn", "--ckpt", str(run_dir), "--from-val", "6", "--examples", "2",
                           "--draws", "4", "--out", str(out)])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    assert stdout.splitlines()[0] == f"checkpoint: {setup['ckpt']} (newest valid in {run_dir})"
    m = _outputs_ok(out)
    assert m["mode"] == "from_val" and m["samples"]["used"] == 6
    assert m["samples"]["by_kind"] == {"image": 2, "video": 2, "interleaved": 2}
    s = m["pointing_game"]["token"]["summary"]
    for cat in ("colour", "shape"):
        assert s[cat]["n"] > 0 and 0 < s[cat]["chance"] < s[cat]["chance_cell"] <= 1
        assert set(s[cat]["accuracy"]) == {"0", "1"}
    assert set(m["headline"]) == {"colour", "shape"}
    assert set(m["attention"]["by_kind"]) == {"image", "video", "interleaved"}
    assert (out / "pointing.png").stat().st_size > 100
    # knockout faithfulness is on by default for --from-val: every method, the controls, the curves
    f = m["faithfulness"]
    assert f["words"] == s["all"]["n"] and f["draws"] == 4 and f["default"] in f["methods"]
    assert {"raw mean", "rollout", "grad", "heads", "box oracle"} <= set(f["methods"])
    assert (out / "faithfulness.png").stat().st_size > 100 and "Knockout faithfulness" in stdout + (
        out / "report.html").read_text()
    assert list(out.glob("examples/*_curves.png")), "each rendered word's curves beside its maps"


def test_word_probe_takes_a_run_directory(setup, capsys):
    from tools.word_probe import main as word_probe

    run_dir = Path(setup["ckpt"]).parent
    assert word_probe(["--ckpt", str(run_dir), "--json"]) == 0
    out, err = capsys.readouterr()
    assert f"checkpoint: {setup['ckpt']} (newest valid in {run_dir})" in err
    assert all(0 <= v["accuracy"] <= 1 for v in json.loads(out).values())


def _bad_image(setup) -> list[str]:
    path = setup["root"] / "broken.png"
    path.write_bytes(b"\x89PNG not really")
    return ["--image", str(path), "--text", "a red circle"]


@pytest.mark.parametrize("case", ["missing_ckpt", "incompatible_ckpt", "bad_image", "long_text", "bad_layers",
                                  "shard_without_key", "missing_key"])
def test_user_errors_are_one_line(setup, tmp_path, capsys, case):
    ckpt = setup["ckpt"]
    args = ["--image", setup["image"], "--text", "a red circle"]
    if case == "missing_ckpt":
        ckpt = str(tmp_path / "nope")
    elif case == "incompatible_ckpt":
        cfg = to_dict(setup["cfg"])
        cfg["model"]["decoder"]["ffn_dim"] = 48  # the weights were saved for 64
        bad = tmp_path / "bad"
        bad.mkdir()
        state = torch.load(Path(ckpt) / "state.pt", weights_only=False)
        torch.save({"model": state["model"], "config": cfg, "layout": 2}, bad / "state.pt")
        ckpt = str(bad)
    elif case == "bad_image":
        args = _bad_image(setup)
    elif case == "long_text":
        args = ["--image", setup["image"], "--text", "a red circle " * 80]
    elif case == "bad_layers":
        args += ["--layers", "0,7"]
    elif case == "shard_without_key":
        args = ["--shard", str(setup["corpus"] / "val" / "image-000000.tar")]
    elif case == "missing_key":
        args = ["--shard", str(setup["corpus"] / "val" / "image-000000.tar"), "--key", "img_12345678"]
    rc, _, err = _run(["--ckpt", ckpt, *args, "--out", str(tmp_path / "o")], capsys)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmtrain: error:"), err
