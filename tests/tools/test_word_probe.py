"""tools/word_probe.py and tools/probe_media.py on a tiny checkpoint whose visual tokens ignore the
pixels (projector output zero): own and swapped media score alike per word class, to the bit, and
the ViT probe of its projected tokens is exactly chance while its pre-projector features are not
constant; tables, --json and user errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from mmtrain.config import apply_override, from_dict, to_dict
from mmtrain.data_pipelines.synth.config import SynthConfig
from mmtrain.data_pipelines.synth.writer import write_corpus
from mmtrain.models.multimodal import MultimodalModel
from mmtrain.run_config import RunConfig
from tools import caption_table, probe_media, word_probe

REPO = Path(__file__).resolve().parents[2]
SMALL = ["data.num_workers=0", "data.batch_size=4", "data.seq_len=192", "data.media.max_pixels=2304",
         "model.vision.dim=32", "model.vision.depth=1", "model.vision.n_heads=2", "model.decoder.dim=32",
         "model.decoder.n_layers=2", "model.decoder.n_heads=2", "model.decoder.n_kv_heads=1",
         "model.decoder.ffn_dim=64", "model.decoder.mrope_sections=[2, 3, 3]",
         "model.decoder.moe.n_routed=4", "model.decoder.moe.expert_dim=32"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    """A random tiny checkpoint ("seeing") and the same with its projector's output zeroed ("blind")."""
    root = tmp_path_factory.mktemp("word_probe")
    corpus = root / "shapes"
    write_corpus(corpus, SynthConfig.small(n_image=4, n_video=2, n_interleaved=2, n_text=4, n_val=12,
                                           shard_size=16), log=None)
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    raw["data"]["tokenizer"] = str(corpus / "tokenizer.json")  # the tools read only the val split
    raw["data"]["val"] = [{**src, "shards": [str(corpus / "val" / f"{src['name']}-*.tar")]}
                          for src in raw["data"]["val"]]
    for item in SMALL:
        apply_override(raw, item)
    cfg = from_dict(RunConfig, raw, source="word-probe-test")
    cfg.model.decoder.vocab_size = json.loads((corpus / "manifest.json").read_text())["vocab_size"]
    model = MultimodalModel(cfg.model)
    out = {}
    for name in ("seeing", "blind"):
        if name == "blind":
            with torch.no_grad():
                model.vision.projector.w_out.weight.zero_()  # every visual token is 0, whatever the pixels
        out[name] = root / name / "step_1"
        out[name].mkdir(parents=True)
        torch.save({"model": model.state_dict(), "config": to_dict(cfg), "layout": 2}, out[name] / "state.pt")
    return {k: str(v) for k, v in out.items()}


def _json(tool, argv: list[str], capsys) -> dict:
    assert tool.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_own_and_swapped_media_score_alike_when_the_pixels_are_ignored(ckpts, capsys):
    blind_ckpt = ckpts["blind"]
    result = _json(word_probe, ["--ckpt", blind_ckpt], capsys)
    keys = {k.rsplit("/", 1)[0] for k in result if k.endswith("/own")}
    assert {"image_text/colour", "image_text/shape", "image_text/size"} <= keys
    for key in keys:
        own, swapped = result[f"{key}/own"], result[f"{key}/swapped"]
        assert own["n"] == swapped["n"] > 0
        assert own == swapped, key  # exact: the media cannot reach the text
        assert result[f"{key}/real"]["n"] >= own["n"]
    assert word_probe.main(["--ckpt", blind_ckpt]) == 0
    table = capsys.readouterr().out
    assert "own vs swap" in table and "out of distribution" in table and "image_text/colour" in table
    seeing = _json(word_probe, ["--ckpt", ckpts["seeing"]], capsys)
    assert any(seeing[f"{k}/own"]["nll"] != seeing[f"{k}/swapped"]["nll"] for k in keys)




def test_the_vit_probe_of_a_blind_projector_is_chance(ckpts, capsys):
    blind_ckpt = ckpts["blind"]
    result = _json(probe_media, ["--ckpt", blind_ckpt, "--media", "12"], capsys)
    assert set(result) == {"colour", "shape", "size"}
    for r in result.values():
        assert r["vit"] == r["chance"] and 0 <= r["vit_pre"] <= 1 and 0 <= r["pixels"] <= 1
        assert r["n"] > r["held_out"] > 0
    assert probe_media.main(["--ckpt", blind_ckpt, "--media", "12"]) == 0
    assert "vit_pre" in capsys.readouterr().out
    assert probe_media.main(["--ckpt", blind_ckpt, "--media", "2"]) == 2
    assert "--media: need at least 3" in capsys.readouterr().err


def test_caption_table_blind_checkpoint_names_alike_with_real_and_blank_media(ckpts, capsys):
    """A model whose visual tokens are 0 whatever the pixels captions a medium and its grey blank
    alike: real and blanked accuracies are equal for every attribute."""
    res = _json(caption_table, ["--ckpt", ckpts["blind"], "--images", "4", "--videos", "2"], capsys)
    assert res["prompts"] >= 4 and res["accuracy"]
    assert res["accuracy"] == res["blank_accuracy"]
    assert res["majority"] and all(0 < v <= 1 for v in res["majority"].values())
    assert caption_table.main(["--ckpt", ckpts["seeing"], "--images", "2", "--videos", "1"]) == 0
    out = capsys.readouterr().out
    assert "| attribute | words | real media | blanked media | majority |" in out
