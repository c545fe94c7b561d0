"""A run trained with `model.vision.out_norm=true` (2 steps) through both exports: `mmtrain export`
keeps the trained gain and generates what the checkpoint generates; `mmtrain export --hf` of that
export carries it under the merger (bit-exact back), and the parity measured at export (transformers
against mmtrain: logits, eager and sdpa, and greedy `generate`) holds. The --hf half is skipped
where transformers is not installed (tests/mmtrain/test_hf_convert.py covers the mapping there)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch

from mmtrain import cli
from mmtrain.config import apply_override, from_dict
from mmtrain.hf.convert import from_hf
from mmtrain.inference.generate import generate, load
from mmtrain.inference.prompts import read_sample, sample_prompt
from mmtrain.loop.trainer import Trainer
from mmtrain.models.inference import SamplingConfig
from mmtrain.run_config import RunConfig

GAIN = "model.visual.merger.out_norm.weight"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus, raw_for):
    torch.set_num_threads(1)
    where = tmp_path_factory.mktemp("out_norm")
    raw = raw_for(where / "run")
    for item in ["train.steps=2", "train.ckpt_every=0", "model.vision.out_norm=true"]:
        apply_override(raw, item)
    summary = Trainer(from_dict(RunConfig, raw, source="out-norm-test"), verbose=False).fit()
    ckpt, plain = Path(summary["checkpoint"]), where / "export"
    assert cli.main(["export", str(ckpt), "--out", str(plain)]) == 0
    return {"ckpt": ckpt, "export": plain, "corpus": corpus}


def _prompts(corpus: Path, media) -> list:
    out = []
    for kind, extra in (("image", "there is"), ("video", "")):
        shard = next((corpus / "val").glob(f"{kind}-*.tar"))
        with tarfile.open(shard) as t:
            key = t.getnames()[0].split(".")[0]
        out.append(sample_prompt(read_sample(str(shard), key), media, extra))
    return out


def test_plain_export_keeps_the_trained_gain_and_generates_as_the_checkpoint(trained):
    ckpt, plain = load(str(trained["ckpt"]), "cpu"), load(str(trained["export"]), "cpu")
    assert plain.cfg.model.vision.out_norm
    gain = ckpt.model.vision.out_norm.weight
    assert not torch.equal(gain, torch.ones_like(gain))  # trained off its init of 1
    assert torch.equal(plain.model.vision.out_norm.weight, gain)
    prompts = _prompts(trained["corpus"], ckpt.cfg.data.media)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=3)
    texts = [[(g.text, g.finish) for g in generate(m, prompts, sampling).generations] for m in (ckpt, plain)]
    assert texts[0] == texts[1] and all(g[1] for g in texts[0])


def test_hf_export_carries_the_gain_and_matches_mmtrain(trained, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "hf"
    assert cli.main(["export", "--hf", str(trained["export"]), "--out", str(out)]) == 0  # parity measured
    hfc = json.loads((out / "config.json").read_text())
    assert hfc["vision"]["out_norm"] is True
    hf = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    state = load(str(trained["ckpt"]), "cpu").model.state_dict()
    assert torch.equal(hf[GAIN], state["vision.out_norm.weight"])
    back = from_hf(hf, hfc, state.keys())
    assert all(torch.equal(back[k], v) for k, v in state.items())
    card = (out / "README.md").read_text()
    rows = [line for line in card.splitlines() if line.startswith("| max abs logit")]
    assert len(rows) == 2 and all(float(r.split("|")[2]) <= 1e-4 for r in rows), rows
    assert "gives mmtrain's text | yes |" in card


def test_hf_export_refuses_out_center(tmp_path, raw_for, capsys):
    """vision.out_center (an experiment's arm) has no HF form: a clear refusal, nothing written."""
    torch.set_num_threads(1)
    raw = raw_for(tmp_path / "run")
    for item in ["train.steps=1", "train.ckpt_every=0", "model.vision.out_norm=true",
                 "model.vision.out_center=true"]:
        apply_override(raw, item)
    ckpt = Trainer(from_dict(RunConfig, raw, source="out-center-test"), verbose=False).fit()["checkpoint"]
    assert cli.main(["export", "--hf", str(ckpt), "--out", str(tmp_path / "hf")]) == 2
    assert "vision.out_center has no Hugging Face form" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
