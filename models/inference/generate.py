"""Token-level generation: prefill, then greedy / temperature / top-p decoding until end-of-document.

Sampling draws every row from its own generator seeded with `seed`, so a prompt's output does not
depend on the other prompts of its batch (batched = each alone). Top-p keeps the smallest set of
most probable tokens whose probability reaches p (nucleus sampling, Holtzman et al. 2020).

Legend: B rows, S prompt tokens, V vocab, D model dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmtrain.checks import check

from .engine import decode_step, encode_media, prefill

Tensor = torch.Tensor


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int = 0

    def __post_init__(self) -> None:
        check(self, "max_new_tokens", ge=1)
        check(self, "temperature", ge=0)
        check(self, "top_p", gt=0, le=1)


@dataclass
class TokenOutput:
    tokens: list[list[int]]  # generated ids per row (the end-of-document id last when it stopped there)
    finish: list[str]  # "eos" or "length" (max_new_tokens or the context reached)
    prompt_len: list[int]
    cache_bytes_per_token: float


def top_p_filter(logits_BV: Tensor, top_p: float) -> Tensor:
    """-inf outside each row's nucleus: the most probable tokens whose mass first reaches top_p."""
    if top_p >= 1:
        return logits_BV
    sorted_BV, order_BV = logits_BV.sort(-1, descending=True)
    p_BV = sorted_BV.softmax(-1)
    before_BV = p_BV.cumsum(-1) - p_BV  # mass of the tokens ranked above
    drop_BV = before_BV >= top_p  # the best token always stays (before = 0)
    return logits_BV.masked_fill(drop_BV.scatter(-1, order_BV, drop_BV), float("-inf"))


def next_tokens(logits_BV: Tensor, cfg: SamplingConfig, gens: Sequence[torch.Generator]) -> Tensor:
    if cfg.temperature == 0:
        return logits_BV.argmax(-1)
    probs_BV = top_p_filter(logits_BV.float() / cfg.temperature, cfg.top_p).softmax(-1)
    return torch.cat([torch.multinomial(p_V, 1, generator=g) for p_V, g in zip(probs_BV, gens)])


@torch.no_grad()
def generate_tokens(model, inputs: dict[str, Tensor], cfg: SamplingConfig, eos_id: int | None,
                    banned: Sequence[int] = (), max_len: int | None = None,
                    visual_QD: Tensor | None = None) -> TokenOutput:
    """Prompts as model inputs (one document per row from position 0, padding -1 after) -> tokens.

    banned: ids never generated (e.g. media placeholders); max_len: prompt + generated tokens
    of a row stop there (the context the model was trained for)."""
    tokens_BS = inputs["tokens_BS"]
    B, S = tokens_BS.shape
    if visual_QD is None:
        visual_QD = encode_media(model, inputs["patches_NP"], inputs["grid_thw_M3"])
    hidden_BSD, cache = prefill(model, **inputs, capacity=S + cfg.max_new_tokens, visual_QD=visual_QD)
    len_B = cache.len_B.clone()
    room = [cfg.max_new_tokens if max_len is None else min(cfg.max_new_tokens, max_len - int(n))
            for n in len_B]
    last_BD = hidden_BSD[torch.arange(B, device=len_B.device), len_B - 1]
    logits_BV = model.decoder.logits(last_BD)
    ban_V = torch.zeros(logits_BV.shape[-1], dtype=torch.bool, device=logits_BV.device)
    ban_V[list(banned)] = True
    gens = [torch.Generator(logits_BV.device).manual_seed(cfg.seed) for _ in range(B)]
    out: list[list[int]] = [[] for _ in range(B)]
    finish = ["length"] * B
    done = [r <= 0 for r in room]
    while not all(done):
        tok_B = next_tokens(logits_BV.masked_fill(ban_V, float("-inf")), cfg, gens)
        for b, t in enumerate(tok_B.tolist()):
            if done[b]:
                continue
            out[b].append(t)
            if t == eos_id:
                done[b], finish[b] = True, "eos"
            elif len(out[b]) >= room[b]:
                done[b] = True
        if all(done):
            break
        logits_BV = decode_step(model, cache, tok_B)
    return TokenOutput(out, finish, len_B.tolist(), cache.bytes_per_token())
