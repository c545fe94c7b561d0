"""Inference from mmtrain: a 2-step run with the captioning eval and the pointing game on, then
`mmtrain generate` and the library API on it.

  * the run's evals carry caption accuracies (summary, metrics.jsonl, the final table) and its
    diagnostics the pointing game, which equals `mmtrain-attn`'s on the same documents;
  * export -> generate equals checkpoint -> generate (and run directory -> generate) bit for bit;
  * the CLI writes one JSON line per prompt; user mistakes are one error line and exit code 2;
  * caption scoring reads attribute words in order ("moves left" is a motion, "top left" a place).
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmtrain import cli
from mmtrain.config import apply_override, from_dict
from mmtrain.data_pipelines.packing import assemble
from mmtrain.evaluation.captioning import CaptionSet, build_caption_set, read_words, score
from mmtrain.evaluation.pointing import grounding_docs, pointing_scores
from mmtrain.evaluation.report import print_summary
from mmtrain.inference.generate import generate, load
from mmtrain.inference.prompts import (
    iter_val_samples,
    medium_file,
    prompt_document,
    read_sample,
    sample_prompt,
)
from mmtrain.loop.trainer import Trainer
from mmtrain.models.inference import SamplingConfig, prefill
from mmtrain.run_config import RunConfig
from mmtrain.state.export import export


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus, raw_for):
    torch.set_num_threads(1)
    raw = raw_for(tmp_path_factory.mktemp("gen") / "run")
    for item in ["train.steps=2", "train.ckpt_every=0", "captions.images=2", "captions.videos=1",
                 "captions.max_new_tokens=8", "diagnostics.every=2", "diagnostics.batches=1",
                 "diagnostics.pointing_media=3", "model.decoder.attention.block_size=4",
                 "model.decoder.attention.window=4", "model.decoder.attention.top_k=1"]:
        apply_override(raw, item)
    summary = Trainer(from_dict(RunConfig, raw, source="gen-test"), verbose=False).fit()
    return {"dir": Path(summary["run_dir"]), "ckpt": Path(summary["checkpoint"]), "summary": summary,
            "corpus": corpus}


def _val(corpus: Path, kind: str) -> tuple[str, str]:
    shard = next((corpus / "val").glob(f"{kind}-*.tar"))
    with tarfile.open(shard) as t:
        return str(shard), t.getnames()[0].split(".")[0]


def _red_png(where: Path) -> Path:
    image = where / "red.png"
    Image.fromarray(np.full((40, 56, 3), (230, 40, 40), np.uint8)).save(image)
    return image


def test_run_reports_captions_and_pointing(run, capsys):
    end = run["summary"]["end"]["captions"]
    assert end["prompts"] == 3 and {"colour", "shape", "size", "motion"} <= set(end["accuracy"])
    assert all(0 <= v <= 1 for v in end["accuracy"].values()) and end["examples"]
    lines = [json.loads(x) for x in (run["dir"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r.get("eval") == "captions"] == [0, 2]
    print_summary(run["summary"])
    table = capsys.readouterr().out
    assert "captions of 3 val images" in table and "blank end" in table and "pointing game" in table
    diag = [json.loads(x) for x in (run["dir"] / "diagnostics.jsonl").read_text().splitlines()]
    assert set(diag[-1]["pointing"]) == {"colour", "shape", "size"}


def test_pointing_game_equals_the_attention_map_tools(run):
    from mmtrain.attention_maps.inputs import doc_from_sample
    from mmtrain.attention_maps.maps import analyze_document
    from mmtrain.attention_maps.metrics import Grounding, summarize_trials

    m = load(str(run["dir"]), "cpu")
    docs = grounding_docs(m.cfg.data, m.tokenizer, 4)
    mine = pointing_scores(m.model, docs, m.device, m.cfg.model)
    layers = list(range(m.cfg.model.decoder.n_layers))
    g, names = Grounding(layers, m.cfg.model.decoder.n_heads), {d.name for d in docs}
    for _, raw in iter_val_samples(m.cfg.data):
        if raw.key in names:
            g.add(analyze_document(m.model, doc_from_sample(raw, m.tokenizer, m.cfg.data), layers))
    theirs = summarize_trials(g.trials["token"], layers)
    for cat, v in mine.items():
        assert v["n"] == theirs[cat]["n"]
        assert v["accuracy"] == pytest.approx(theirs[cat]["accuracy_mean_layers"], abs=1e-9)
        assert v["chance_cell"] == pytest.approx(theirs[cat]["chance_cell"], abs=1e-9)


def test_export_generates_what_the_checkpoint_generates(run, tmp_path):
    out = export(run["ckpt"], tmp_path / "export")
    models = [load(str(p), "cpu") for p in (run["ckpt"], out, run["dir"])]
    shard, key = _val(run["corpus"], "video")
    img_shard, img_key = _val(run["corpus"], "image")
    prompts = [sample_prompt(read_sample(shard, key), models[0].cfg.data.media),
               sample_prompt(read_sample(img_shard, img_key), models[0].cfg.data.media, "there is")]
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=3)
    texts = [[(g.text, g.finish) for g in generate(m, prompts, sampling).generations] for m in models]
    assert texts[0] == texts[1] == texts[2]
    doc = prompt_document(prompts[1], models[0].tokenizer, models[0].cfg.data)
    inputs = assemble([[doc]], len(doc), 0, models[0].cfg.model.vision.patch_dim).model_inputs()
    h_ckpt, h_export = (prefill(m.model, **inputs, capacity=len(doc) + 1)[0] for m in models[:2])
    assert torch.equal(h_ckpt, h_export)


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = cli.main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_sample_image_and_jsonl(run, tmp_path, capsys):
    shard, key = _val(run["corpus"], "image")
    out = tmp_path / "gen.jsonl"
    argv = ["--ckpt", str(run["dir"]), "--shard", shard, "--key", key, "--max-new-tokens", "4",
            "--out", str(out)]
    rc, stdout, err = _cli(argv, capsys)
    assert rc == 0 and stdout.startswith(f"{key}: ") and "bytes/token" in err
    assert f"checkpoint: {run['dir']}/step_" in err and f"(newest valid in {run['dir']})" in err
    rec = json.loads(out.read_text())
    assert rec["reference"] and rec["new_tokens"] <= 4 and rec["finish"] in ("eos", "length")
    _, vid = _val(run["corpus"], "video")
    both = str(run["corpus"] / "val" / "{image,video}-000000.tar")
    argv = ["--ckpt", str(run["dir"]), "--shard", both, "--key", vid, key, "--max-new-tokens", "2"]
    rc, stdout, _ = _cli(argv, capsys)
    names = [line.split(":")[0] for line in stdout.splitlines() if not line.startswith(" ")]
    assert rc == 0 and names == [vid, key] and stdout.count("  reference: ") == 2
    _red_png(tmp_path)
    lines = [{"image": "red.png", "prompt": "there is a", "name": "red"}, {"text": "the circle is"}]
    (tmp_path / "p.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    rc, stdout, _ = _cli(["--ckpt", str(run["ckpt"]), "--jsonl", str(tmp_path / "p.jsonl"), "--temperature",
                          "0.7", "--top-p", "0.8", "--seed", "1", "--max-new-tokens", "3"], capsys)
    assert rc == 0 and stdout.splitlines()[0].startswith("red: there is a")
    assert len(stdout.splitlines()) == 2


def _bad_cases(run, tmp_path) -> dict[str, tuple[list[str], str]]:
    shard, key = _val(run["corpus"], "image")
    (tmp_path / "bad.png").write_bytes(b"not an image")
    (tmp_path / "bad.jsonl").write_text('{"image": "missing.png"}\n')
    ck = ["--ckpt", str(run["dir"])]
    return {
        "missing image": ([*ck, "--image", str(tmp_path / "none.png")], "cannot read"),
        "undecodable image": ([*ck, "--image", str(tmp_path / "bad.png")], "cannot decode image"),
        "prompt too long": ([*ck, "--image", str(_red_png(tmp_path)), "--prompt", "a red circle " * 200],
                            "longer than the context"),
        "shard without key": ([*ck, "--shard", shard], "--key"),
        "no such key": ([*ck, "--shard", shard, "--key", "nope"], "no such sample"),
        "bad temperature": ([*ck, "--shard", shard, "--key", key, "--temperature", "-1"], "--temperature"),
        "bad top-p": ([*ck, "--shard", shard, "--key", key, "--top-p", "0"], "--top-p"),
        "missing checkpoint": (["--ckpt", str(tmp_path / "nothing"), "--shard", shard, "--key", key],
                               "no such checkpoint"),
        "jsonl medium missing": ([*ck, "--jsonl", str(tmp_path / "bad.jsonl")], "missing.png"),
    }


@pytest.mark.parametrize("case", ["missing image", "undecodable image", "prompt too long",
                                  "shard without key", "no such key", "bad temperature", "bad top-p",
                                  "missing checkpoint", "jsonl medium missing"])
def test_cli_user_errors_are_one_line(run, tmp_path, capsys, case):
    argv, words = _bad_cases(run, tmp_path)[case]
    rc, _, err = _cli(argv, capsys)
    assert rc == 2 and err.startswith("mmtrain: error:") and len(err.strip().splitlines()) == 1, err
    assert words in err, err


def test_caption_scoring_reads_attribute_words_in_order(run):
    m = load(str(run["ckpt"]), "cpu")
    cs = build_caption_set(m.cfg.data, m.cfg.captions)
    assert cs.note is None and len(cs.prompts) == 3
    words = read_words("a small red circle moves left and a large blue star at the top left.", cs)
    assert words["motion"] == ["moves left"] and words["position"] == ["top left"]
    truth = {"color": ["red", "blue"], "shape": ["circle", "star"], "size": ["small", "large"]}
    got = score("there is a small red circle at the left and a small blue cross at the top.", truth, cs)
    assert got == {"color": (2, 2), "shape": (1, 2), "size": (1, 2)}
    assert score("a blue circle", truth, cs)["color"] == (0, 2)
    empty = CaptionSet(note="skipped")
    assert empty.note and not empty.prompts


def test_prompts_are_training_documents_without_their_end(run):
    m = load(str(run["ckpt"]), "cpu")
    shard, key = _val(run["corpus"], "image")
    raw = read_sample(shard, key)
    p = sample_prompt(raw, m.cfg.data.media)
    doc = prompt_document(p, m.tokenizer, m.cfg.data)
    s = m.tokenizer.special
    assert doc.tokens_L[0] == s.bos and doc.tokens_L[1] == s.image_start and doc.tokens_L[-1] == s.image_end
    assert p.reference == raw.members["txt"].decode().strip()
    alone = prompt_document(medium_file(_red_png(run["dir"].parent), "image", m.cfg.data.media), m.tokenizer,
                            m.cfg.data)
    assert (alone.modality_L != 0).sum() > 0 and alone.tokens_L[-1] == s.image_end
