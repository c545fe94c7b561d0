"""`mmtrain export --hf`: a random tiny model (no training) exported once per variant, then loaded by
transformers and compared with mmtrain itself, fp32 on CPU, offline.

Variants: "block" selection per kv group with sigmoid routing, untied head, the vision out_norm on,
the training-only visual head (model.visual_head: left out of the export, parity unaffected) (one
safetensors file); "token" selection per head with softmax routing, modality expert groups,
tied embeddings, no out_norm (sharded).
Both: sparse layers that really cut blocks (checked), MoE expert biases that are not zero.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mmtrain import cli
from mmtrain.config import apply_override, from_dict
from mmtrain.data_pipelines.packing import assemble
from mmtrain.errors import UserError
from mmtrain.hf.convert import TRAINING_ONLY, from_hf
from mmtrain.inference.export_hf import export_hf
from mmtrain.inference.generate import generate, load
from mmtrain.inference.prompts import prompt_document, read_sample, sample_prompt
from mmtrain.models.inference import SamplingConfig, generate_tokens
from mmtrain.models.multimodal import MultimodalModel
from mmtrain.run_config import RunConfig

transformers = pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"
VARIANTS = {
    "block": [
        "model.decoder.attention.select=block",
        "model.decoder.moe.score=sigmoid",
        "model.vision.out_norm=true",
        "model.visual_head=true",
    ],
    "token": [
        "model.decoder.attention.select=token",
        "model.decoder.attention.select_per=head",
        "model.decoder.moe.score=softmax",
        "model.decoder.tie_embeddings=true",
        "model.decoder.moe.modality_groups=true",
        "model.decoder.moe.n_text_experts=2",
        "model.decoder.moe.n_visual_experts=2",
    ],
}
COMMON = [
    "model.decoder.n_layers=3",
    "model.decoder.attention.block_size=4",
    "model.decoder.attention.window=4",
    "model.decoder.attention.top_k=1",
    "model.decoder.attention.visual_always=false",
    "model.decoder.layer_layout=FS",
]


def _random_model(cfg: RunConfig) -> MultimodalModel:
    model = MultimodalModel(cfg.model)
    with torch.no_grad():
        for name, t in model.state_dict().items():  # no trained weights: perturb what init leaves constant
            if name.endswith("expert_bias_E"):
                t.copy_(torch.randn_like(t) * 0.05)
            elif name.endswith("norm.weight"):
                t.add_(torch.randn_like(t) * 0.2)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def exported(request, tmp_path_factory, corpus, raw_for):
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    where = tmp_path_factory.mktemp(f"hf_{request.param}")
    raw = raw_for(where / "run")
    for item in COMMON + VARIANTS[request.param]:
        apply_override(raw, item)
    cfg = from_dict(RunConfig, raw, source="hf-test")
    src = where / "mm"
    src.mkdir()
    tok_file = Path(cfg.data.tokenizer)
    (src / "tokenizer.json").write_bytes(tok_file.read_bytes())
    from mmtrain.data_pipelines.tokenizer import load_tokenizer

    cfg.model.decoder.vocab_size = load_tokenizer(tok_file).vocab_size
    model = _random_model(cfg)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, src / "model.safetensors",
              metadata={"layout": "2"})  # this code's rows (state/layout.py)
    (src / "config.yaml").write_text(yaml.safe_dump(asdict(cfg)), encoding="utf-8")
    out = export_hf(
        src,
        where / "hf",
        max_shard_mib=0.05 if request.param == "token" else 4096,
        parity=request.param == "block",
    )
    return {
        "name": request.param,
        "src": src,
        "out": out,
        "m": load(str(src), "cpu"),
        "corpus": corpus,
        "state": model.state_dict(),
    }


def _hf(exported, impl: str = "eager"):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(
        exported["out"], trust_remote_code=True, attn_implementation=impl
    ).eval()


def _proc(exported):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(exported["out"], trust_remote_code=True)


def _val(corpus: Path, kind: str, i: int = 0):
    shard = corpus / "val" / f"{kind}-000000.tar"
    key = {"image": "img", "video": "vid", "interleaved": "doc", "text": "txt"}[kind] + f"_{i:08d}"
    return read_sample(str(shard), key)


def _prompts(exported):
    """(mmtrain Prompt, processor kwargs) for an image, a video, an interleaved doc and a text."""
    from mmtrain.data_pipelines.preprocess import Decoded

    media = exported["m"].cfg.data.media
    out = []
    for kind, extra in (("image", ""), ("video", " a large"), ("interleaved", ""), ("text", "")):
        p = sample_prompt(_val(exported["corpus"], kind), media, extra)
        text, images, videos = "", [], []
        for s in p.segments if p.segments else [p.text]:
            if isinstance(s, Decoded):
                text += "<|image_pad|>" if s.kind == 1 else "<|video_pad|>"
                (images if s.kind == 1 else videos).append(s.frames_THWC[0] if s.kind == 1 else s.frames_THWC)
            else:
                text += s
        text += p.text if p.segments else ""
        out.append((p, {"text": text, "images": images or None, "videos": videos or None}))
    return out


def _batch(m, prompts):
    docs = [prompt_document(p, m.tokenizer, m.cfg.data) for p in prompts]
    return docs, assemble(
        [[d] for d in docs], max(len(d) for d in docs), m.tokenizer.special.pad, m.cfg.model.vision.patch_dim
    )


def test_the_sparse_layers_really_select(exported):
    m = exported["m"]
    _, batch = _batch(m, [p for p, _ in _prompts(exported)])
    with torch.no_grad():
        stats = m.model(**batch.model_inputs(), attn_stats=True).attn_stats
    sparse = [s for i, s in stats.items() if m.cfg.model.decoder.is_sparse(i)]
    assert sparse and all(float(s["kept"]) < float(s["reachable"]) for s in sparse)


def test_weights_round_trip_bit_exact(exported):
    from safetensors.torch import load_file

    files = sorted(exported["out"].glob("*.safetensors"))
    assert (len(files) > 1) == (exported["name"] == "token")  # sharded: with its index
    assert (exported["out"] / "model.safetensors.index.json").is_file() == (len(files) > 1)
    hf = {k: v for f in files for k, v in load_file(f).items()}
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in hf)
    assert any("self_attn.q_proj.weight" in k for k in hf)
    assert ("model.visual.merger.out_norm.weight" in hf) == (exported["name"] == "block")
    state = exported["state"]
    assert ("visual_head.weight" in state) == (exported["name"] == "block")
    assert not any("visual_head" in k for k in hf)  # training-only: not exported
    back = from_hf(hf, json.loads((exported["out"] / "config.json").read_text()), state.keys())
    assert back.keys() == state.keys() - set(TRAINING_ONLY)
    for k, v in back.items():
        assert v.dtype == state[k].dtype and torch.equal(v, state[k]), k


def test_transformers_loads_every_weight(exported):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        exported["out"], trust_remote_code=True, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(model).__name__ == "MmtrainForConditionalGeneration"
    assert model.config.image_token_id == exported["m"].tokenizer.special.image_pad


def test_an_export_whose_config_predates_out_norm_loads_as_before(exported):
    """config.json written before the flag existed: no out_norm in `vision`, no gain to load. (The
    classes already loaded, not a copy of the folder: a second remote-code module would re-register
    the cache layer types under its own classes for every model in this process.)"""
    if exported["name"] != "token":
        pytest.skip("the variant without out_norm")
    hf = _hf(exported)
    hfc = json.loads((exported["out"] / "config.json").read_text())
    assert hfc["vision"].pop("out_norm") is False
    old = type(hf)(type(hf.config).from_dict(hfc))
    assert old.config.vision["out_norm"] is False and old.model.visual.merger.out_norm is None
    old.load_state_dict(hf.state_dict())  # strict: the same weights, none missing or left over


@pytest.mark.parametrize("which", [0, 1, 2, 3], ids=["image", "video", "interleaved", "text"])
def test_processor_builds_mmtrain_packed_batch(exported, which):
    p, kwargs = _prompts(exported)[which]
    m, proc = exported["m"], _proc(exported)
    (doc,), batch = _batch(m, [p])
    inputs = proc(**kwargs, return_tensors="pt")
    assert torch.equal(inputs["input_ids"][0], batch.tokens_BS[0])
    kinds = batch.media_kind_M.tolist()
    for kind, pix, grid in (
        (1, "pixel_values", "image_grid_thw"),
        (2, "pixel_values_videos", "video_grid_thw"),
    ):
        rows = [g for g, k in zip(batch.grid_thw_M3, kinds) if k == kind]
        if not rows:
            assert pix not in inputs
            continue
        sizes = batch.grid_thw_M3.prod(-1).tolist()
        patches = torch.cat([x for x, k in zip(batch.patches_NP.split(sizes), kinds) if k == kind])
        assert torch.equal(inputs[pix], patches) and torch.equal(inputs[grid], torch.stack(rows))
    if which == 2:
        assert kinds.count(1) >= 2  # an interleaved document with two images or more
    layout = importlib.import_module(type(_hf(exported)).__module__.rsplit(".", 1)[0] + ".layout_mmtrain")
    cfg = json.loads((exported["out"] / "config.json").read_text())
    lay = layout.token_layout(
        inputs["input_ids"],
        inputs["attention_mask"].bool(),
        inputs.get("image_grid_thw"),
        inputs.get("video_grid_thw"),
        cfg["image_token_id"],
        cfg["video_token_id"],
        cfg["vision"]["spatial_merge_size"],
    )
    assert torch.equal(lay.pos_3BS, batch.pos_ids_3BS)
    assert torch.equal(lay.span_BS, batch.span_ids_BS.long()) and torch.equal(
        lay.modality_BS, batch.modality_BS.long()
    )


def test_video_frames_are_sampled_as_mmtrain_samples_them(exported):
    from mmtrain.data_pipelines.decode import sample_frame_indices

    media, ip = exported["m"].cfg.data.media, _proc(exported).image_processor
    rng = np.random.default_rng()
    for n, fps in zip(rng.integers(1, 400, 20).tolist(), [0.0, *rng.uniform(1, 60, 19).tolist()]):
        assert ip.frame_indices(n, fps) == sample_frame_indices(n, fps, media)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_logits_equal_mmtrain_batched_left_padded_and_alone(exported, impl):
    m, proc, hf = exported["m"], _proc(exported), _hf(exported, impl)
    pairs = _prompts(exported)
    docs, batch = _batch(m, [p for p, _ in pairs])
    with torch.no_grad():
        ref_BSV = m.model(**batch.model_inputs()).logits_BSV
        merged = {
            "text": [k["text"] for _, k in pairs],
            "images": [x for _, k in pairs for x in (k["images"] or [])],
            "videos": [x for _, k in pairs for x in (k["videos"] or [])],
        }
        inputs = proc(**merged, return_tensors="pt")
        assert (inputs["attention_mask"] == 0).any()  # some rows are left-padded
        out_BSV = hf(**inputs).logits
        for b, d in enumerate(docs):
            assert (out_BSV[b, -len(d) :] - ref_BSV[b, : len(d)]).abs().max() <= 1e-4
            alone = hf(**proc(**pairs[b][1], return_tensors="pt")).logits[0]
            assert (alone - ref_BSV[b, : len(d)]).abs().max() <= 1e-4


def test_generate_equals_mmtrain_generate(exported):
    """Greedy, across several sparse blocks, through transformers' cache and without it."""
    m, proc, hf = exported["m"], _proc(exported), _hf(exported)
    pairs = _prompts(exported)[:2]  # a val image and a val video
    n_new = 4 * m.cfg.model.decoder.attention.block_size + 3
    res = generate(m, [p for p, _ in pairs], SamplingConfig(max_new_tokens=n_new))
    _, batch = _batch(m, [p for p, _ in pairs])
    special = m.tokenizer.special
    banned = [i for i in special.as_tuple() if i != special.eos]
    ids = generate_tokens(
        m.model, batch.model_inputs(), SamplingConfig(max_new_tokens=n_new), special.eos, banned
    ).tokens
    merged = {
        "text": [k["text"] for _, k in pairs],
        "images": pairs[0][1]["images"],
        "videos": pairs[1][1]["videos"],
    }
    inputs = proc(**merged, return_tensors="pt")
    for use_cache in (True, False):
        with torch.no_grad():
            out = hf.generate(**inputs, max_new_tokens=n_new, use_cache=use_cache)
        new = out[:, inputs["input_ids"].shape[1] :]
        assert [row[: len(r)].tolist() for row, r in zip(new, ids)] == ids
        assert proc.batch_decode(new, skip_special_tokens=True) == [g.text for g in res.generations]


def test_lm_eval_loglikelihood_equals_mmtrain(exported):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    m = exported["m"]
    lm = HFLM(
        pretrained=str(exported["out"]),
        trust_remote_code=True,
        add_bos_token=True,
        batch_size=2,
        device="cpu",
        dtype="float32",
    )
    reqs = [("a small red", " circle"), ("at the top there is", " a large blue square"), ("moves", " left")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(reqs)])
    for (ctx, cont), (ll, _) in zip(reqs, got):
        ids = [m.tokenizer.special.bos, *m.tokenizer.encode(ctx), *m.tokenizer.encode(cont)]
        n = len(m.tokenizer.encode(cont))
        tokens = torch.tensor([ids])
        S = tokens.shape[1]
        with torch.no_grad():
            logits = m.model(
                tokens,
                torch.arange(S).expand(3, 1, S),
                torch.zeros(1, S, dtype=torch.int32),
                torch.full((1, S), -1, dtype=torch.int32),
                torch.zeros(1, S, dtype=torch.int8),
                torch.zeros(0, m.cfg.model.vision.patch_dim),
                torch.zeros(0, 3, dtype=torch.long),
            ).logits_BSV
        logp = logits[0, :-1].log_softmax(-1).gather(-1, tokens[0, 1:, None])[:, 0]
        assert abs(ll - float(logp[-n:].sum())) <= 1e-4
    assert lm_eval.__version__


def test_an_image_alone_is_the_caption_prompt(exported):
    """proc(images=image) with no text is the caption prompt (the image alone, as `mmtrain generate
    --image` builds it); greedy `generate` by the folder's generation config, decoded, is the text
    mmtrain prints."""
    m, proc, hf = exported["m"], _proc(exported), _hf(exported)
    prompt, kwargs = _prompts(exported)[0]  # a val image, no text after it
    inputs = proc(images=kwargs["images"][0], return_tensors="pt")
    spelled = proc(text="<|image_pad|>", images=kwargs["images"], return_tensors="pt")
    assert torch.equal(inputs["input_ids"], spelled["input_ids"])
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=12)
    text = proc.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text == [generate(m, [prompt], SamplingConfig(max_new_tokens=12)).generations[0].text]


def test_lmms_eval_model_scores_and_captions_as_mmtrain(exported):
    """lmms-eval's `mmtrain` model on the export: an image prompt's log-likelihood is mmtrain's summed
    log-probabilities, and its greedy caption (cut at the task's `until`) mmtrain generate's."""
    pytest.importorskip("lmms_eval")
    from types import SimpleNamespace

    from PIL import Image

    from mmtrain.data_pipelines.preprocess import Decoded
    from mmtrain.inference.lmms_eval_model import MmtrainLMM

    m, sample, cont = exported["m"], _val(exported["corpus"], "image"), " a large"
    p0, p1 = (sample_prompt(sample, m.cfg.data.media, extra) for extra in ("", cont))
    image = Image.fromarray(next(s for s in p0.segments if isinstance(s, Decoded)).frames_THWC[0])
    _, batch = _batch(m, [p1])
    with torch.no_grad():
        logits_SV = m.model(**batch.model_inputs()).logits_BSV[0]
    tok_S, n = batch.tokens_BS[0], len(m.tokenizer.encode(cont))
    ref = float(logits_SV[:-1].log_softmax(-1).gather(-1, tok_S[1:, None])[-n:].sum())
    lm = MmtrainLMM(str(exported["out"]))
    lm.task_dict = {"t": {"test": [{"image": image}]}}
    visual = lambda doc: [doc["image"]]  # noqa: E731
    req = SimpleNamespace(args=("<|image_pad|>" + p0.text, cont, visual, 0, "t", "test"))
    (ll, _), = lm.loglikelihood([req])
    assert abs(ll - ref) <= 1e-4
    kwargs = {"max_new_tokens": 9, "until": ["."]}
    text, = lm.generate_until([SimpleNamespace(args=(p0.text, kwargs, visual, 0, "t", "test"))])
    assert text == generate(m, [p0], SamplingConfig(max_new_tokens=9)).generations[0].text.split(".")[0]


def test_the_folder_works_where_mmtrain_is_not_importable(exported, tmp_path):
    """A fresh interpreter that sees the venv's packages but not the repository nor mmtrain's
    editable install (-S skips site and its .pth finders; PYTHONPATH adds site-packages back)."""
    import transformers as tf

    site = str(Path(tf.__file__).resolve().parents[1])
    code = (
        "import importlib.util, json, sys, torch\n"
        "assert importlib.util.find_spec('mmtrain') is None, 'mmtrain is importable'\n"
        "from transformers import AutoModelForImageTextToText, AutoProcessor\n"
        f"d = {str(exported['out'])!r}\n"
        "proc = AutoProcessor.from_pretrained(d, trust_remote_code=True)\n"
        "model = AutoModelForImageTextToText.from_pretrained(d, trust_remote_code=True)\n"
        "inputs = proc(text='a small', return_tensors='pt')\n"
        "out = model.generate(**inputs, max_new_tokens=6)\n"
        "print(json.dumps(out[0, inputs['input_ids'].shape[1]:].tolist()))\n"
    )
    env = {
        "PYTHONPATH": site,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf_home"),
        "PATH": os.environ["PATH"],
    }
    run = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    m = exported["m"]
    from mmtrain.inference.prompts import Prompt

    (doc,), batch = _batch(m, [Prompt("t", "text", [], "a small")])
    special = m.tokenizer.special
    want = generate_tokens(
        m.model,
        batch.model_inputs(),
        SamplingConfig(max_new_tokens=6),
        special.eos,
        [i for i in special.as_tuple() if i != special.eos],
    ).tokens[0]
    assert json.loads(run.stdout.strip().splitlines()[-1])[: len(want)] == want


def test_model_card_and_configs(exported):
    out = exported["out"]
    card = (out / "README.md").read_text()
    assert "## Weight spec" in card and "Sparse block rule" in card
    assert ("`model.visual.merger.out_norm.weight`" in card) == (exported["name"] == "block")
    gen = json.loads((out / "generation_config.json").read_text())
    special = exported["m"].tokenizer.special
    assert gen["eos_token_id"] == special.eos and special.eos not in gen["suppress_tokens"]
    assert set(gen["suppress_tokens"]) == set(special.as_tuple()) - {special.eos}
    if exported["name"] == "block":  # parity measured at export
        rows = [line for line in card.splitlines() if line.startswith("| max abs logit")]
        assert len(rows) == 2 and all(float(r.split("|")[2]) <= 1e-4 for r in rows)
        assert "gives mmtrain's text | yes |" in card
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(out)
    assert isinstance(AutoTokenizer.from_pretrained(out, trust_remote_code=True), PreTrainedTokenizerFast)
    assert tok("a small").input_ids == [special.bos, *exported["m"].tokenizer.encode("a small")]
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " a small"}]}]
    assert _proc(exported).apply_chat_template(msgs, tokenize=False) == "<|image_pad|> a small"


def test_other_attention_implementations_are_refused(exported):
    hf = _hf(exported)
    assert type(hf)._supports_attention_backend is False  # vLLM's Transformers backend refuses the class
    hf.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="block rule"):
        hf(input_ids=torch.tensor([[exported["m"].tokenizer.special.bos]]))


def test_bad_input_is_one_line(exported, tmp_path, capsys):
    with pytest.raises(UserError, match="no such checkpoint"):
        export_hf(tmp_path / "nothing", tmp_path / "out")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not an HF export"):
        export_hf(exported["src"], tmp_path / "taken", parity=False)
    bad = tmp_path / "bad"
    bad.mkdir()
    from safetensors.torch import save_file

    state = {**exported["state"], "decoder.layers.0.attn.new_gate": torch.zeros(2)}
    save_file({k: v.contiguous() for k, v in state.items()}, bad / "model.safetensors",
              metadata={"layout": "2"})
    for f in ("config.yaml", "tokenizer.json"):
        (bad / f).write_bytes((exported["src"] / f).read_bytes())
    assert cli.main(["export", "--hf", str(bad), "--out", str(tmp_path / "o"), "--no-parity"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "new_gate" in err[0]
    assert (
        cli.main(["export", "--hf", str(exported["src"]), "--out", str(tmp_path / "o2"), "--no-parity"]) == 0
    )
