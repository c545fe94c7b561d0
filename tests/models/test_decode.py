"""KV-cache decoding is the full forward, token by token (fp32, CPU):

  * prefill a prompt (text, images, a video), then feed the rest of the document one token at a
    time: the logits at every position equal one full forward over the whole document (1e-4),
    for layouts F, S, FS, with and without MoE, both selection rules, per-group and per-head
    selection, block sizes small enough that top_k < candidates;
  * prompts of different lengths decoded in one batch give what each gives alone;
  * generation: greedy = argmax of the full forward's logits; seeded sampling repeats; top-p keeps
    the nucleus.
Random configs, documents and split points every run (seed printed).

Legend: B rows, S tokens, V vocab, P patch dim.
"""

from __future__ import annotations

import random

import pytest
import torch

from mmtrain.models.attention import AttentionConfig
from mmtrain.models.decoder import DecoderConfig
from mmtrain.models.inference import SamplingConfig, decode_step, generate_tokens, prefill, top_p_filter
from mmtrain.models.moe import MoEConfig
from mmtrain.models.multimodal import ModelConfig, MultimodalModel
from mmtrain.models.testing import IMAGE, VIDEO, pack, random_doc
from mmtrain.models.vision import VisionConfig

V = 64


def make_model(layout: str, moe: bool, select: str) -> MultimodalModel:
    Bs = random.choice([2, 3, 4])
    attn = AttentionConfig(block_size=Bs, window=random.choice([0, Bs]), top_k=random.randint(1, 2),
                           sink=random.random() < 0.5, visual_always=random.random() < 0.5, select=select,
                           select_per=random.choice(["kv_group", "head"]))
    moe_cfg = MoEConfig(n_routed=4, top_k=2, n_shared=1, expert_dim=16, first_dense_layers=1) if moe else None
    K = random.choice([1, 2])
    dec = DecoderConfig(vocab_size=V, dim=32, n_layers=3, n_heads=4, n_kv_heads=K, ffn_dim=48,
                        mrope_sections=(1, 1, 2), layer_layout=layout, attention=attn, moe=moe_cfg)
    return MultimodalModel(ModelConfig(VisionConfig(dim=16, depth=1, n_heads=2, patch_size=4), dec)).eval()


def prompt_doc(P: int) -> list:
    """Text, an image and a video in random order (sometimes a second image), text after each."""
    media = random.sample([(IMAGE, (1, 4, 4)), (VIDEO, (2, 4, 4))], 2)
    media += [(IMAGE, (1, 4, 6))] * random.randint(0, 1)
    return random_doc(V, P, random.randint(4, 20), tuple(media))


def doc_len(doc: list) -> int:
    return sum(s.numel() if isinstance(s, torch.Tensor) else
               s.grid_thw[0] * (s.grid_thw[1] // 2) * (s.grid_thw[2] // 2) for s in doc)


def full_logits(model, doc: list, sparse_check: bool = False) -> torch.Tensor:
    """The full forward's logits (S, V); sparse_check: every sparse layer dropped blocks (kept <
    reachable), so that decoding had a selection to reproduce."""
    P = model.cfg.vision.patch_dim
    with torch.no_grad():
        out = model(**pack([[doc]], doc_len(doc), P), attn_stats=sparse_check)
    for layer, st in out.attn_stats.items():
        if model.cfg.decoder.is_sparse(layer):
            assert float(st["kept"]) < float(st["reachable"]), f"layer {layer} kept every block"
    return out.logits_BSV[0]


def decode_logits(model, prompts: list[list], conts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Prefill the prompts as one batch, feed each continuation token by token -> (S_b, V) per row."""
    P = model.cfg.vision.patch_dim
    lens = [doc_len(d) for d in prompts]
    hidden_BSD, cache = prefill(model, **pack([[d] for d in prompts], max(lens), P),
                                capacity=max(lens) + max(c.numel() for c in conts))
    pre_BSV = model.decoder.logits(hidden_BSD)
    steps = [[] for _ in prompts]
    n = max(c.numel() for c in conts)
    for j in range(n):
        tok_B = torch.stack([c[min(j, c.numel() - 1)] for c in conts])
        logits_BV = decode_step(model, cache, tok_B)
        for b, c in enumerate(conts):
            if j < c.numel():
                steps[b].append(logits_BV[b])
    return [torch.cat([pre_BSV[b, :lens[b]], torch.stack(steps[b])]) for b in range(len(prompts))]


CASES = [(layout, moe, select) for layout in ("F", "S", "FS") for moe in (False, True)
         for select in ("token", "block")]


@pytest.mark.parametrize("layout,moe,select", CASES)
def test_prefill_then_decode_equals_full_forward(seed, layout, moe, select):
    model = make_model(layout, moe, select)
    P = model.cfg.vision.patch_dim
    prompt, cont = prompt_doc(P), torch.randint(3, V, (random.randint(20, 40),))
    ref_SV = full_logits(model, [*prompt, cont], sparse_check=True)
    (got_SV,) = decode_logits(model, [prompt], [cont])
    err = (got_SV - ref_SV).abs().max().item()
    assert err < 1e-4, f"seed={seed}: decode differs from the full forward by {err:.2e} ({model.cfg.decoder})"


@pytest.mark.parametrize("select", ["token", "block"])
def test_batched_prompts_of_different_lengths_equal_each_alone(seed, select):
    model = make_model("FS", True, select)
    P = model.cfg.vision.patch_dim
    prompts = [prompt_doc(P) for _ in range(3)]
    conts = [torch.randint(3, V, (random.randint(5, 20),)) for _ in prompts]
    together = decode_logits(model, prompts, conts)
    for b, (d, c) in enumerate(zip(prompts, conts)):
        (alone_SV,) = decode_logits(model, [d], [c])
        err = (together[b] - alone_SV).abs().max().item()
        assert err < 1e-4, f"seed={seed} row {b}: batched differs from alone by {err:.2e}"
        full_err = (together[b] - full_logits(model, [*d, c])).abs().max().item()
        assert full_err < 1e-4, f"seed={seed} row {b}: batched differs from the full forward ({full_err:.2e})"


def test_greedy_generation_follows_the_full_forward(seed):
    model = make_model("FS", True, random.choice(["token", "block"]))
    P = model.cfg.vision.patch_dim
    prompt = prompt_doc(P)
    out = generate_tokens(model, pack([[prompt]], doc_len(prompt), P), SamplingConfig(max_new_tokens=12),
                          eos_id=None)
    gen = torch.tensor(out.tokens[0])
    assert out.finish == ["length"] and gen.numel() == 12
    ref_SV = full_logits(model, [*prompt, gen])
    n = doc_len(prompt)
    assert torch.equal(ref_SV[n - 1:-1].argmax(-1), gen), f"seed={seed}"
    assert out.cache_bytes_per_token > 0


def test_sampling_is_seeded_and_stops_at_eos(seed):
    model = make_model("FS", False, "token")
    P = model.cfg.vision.patch_dim
    inputs = pack([[prompt_doc(P)], [prompt_doc(P)]], 200, P)
    cfg = SamplingConfig(max_new_tokens=10, temperature=1.5, top_p=0.9, seed=seed)
    a, b = (generate_tokens(model, inputs, cfg, eos_id=None).tokens for _ in range(2))
    assert a == b
    eos = a[0][3]
    out = generate_tokens(model, inputs, cfg, eos_id=eos)
    assert out.tokens[0] == a[0][:a[0].index(eos) + 1] and out.finish[0] == "eos"
    banned = list(range(3, V, 2))  # banning changes the distribution: only check they never come
    out = generate_tokens(model, inputs, cfg, eos_id=None, banned=banned)
    assert not set(banned) & {t for row in out.tokens for t in row}


def test_top_p_keeps_the_nucleus():
    logits_1V = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda p: torch.isfinite(top_p_filter(logits_1V, p))[0].tolist()  # noqa: E731
    assert keep(0.5) == [True, False, False, False]
    assert keep(0.6) == [True, True, False, False]
    assert keep(0.95) == [True, True, True, False]
    assert keep(1.0) == [True] * 4
