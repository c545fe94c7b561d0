"""Inference for `MultimodalModel`: prefill, a KV cache for every layer kind, one-token decode steps.

    from mmtrain.models.inference import SamplingConfig, generate_tokens, prefill, decode_step
    hidden_BSD, cache = prefill(model, **inputs, capacity=S + 64)   # prompts: one document per row
    logits_BV = decode_step(model, cache, tokens_B)                  # append one text token per row
    out = generate_tokens(model, inputs, SamplingConfig(temperature=0.8, top_p=0.9), eos_id)

Decoding applies exactly the training rule of `models.attention` (the block rule is
`blocks.kept` itself): full layers attend to every cached key; sparse layers keep their block
means (cached, final once a block completes) and, for select == "block", the previous block's mean
query, pick top_k of the completed earlier blocks as training does and gather only the kept
blocks' K/V. MoE layers route every decoded token on its own. So prefill + decoding reproduces the
full forward's logits at every position (tests/models/test_decode.py), and the cost of a sparse
layer's step grows with the kept blocks, not with the context.
"""

from .cache import KVCache, LayerCache
from .engine import decode_step, encode_media, new_cache, prefill, prompt_lengths
from .generate import SamplingConfig, TokenOutput, generate_tokens, top_p_filter

__all__ = ["KVCache", "LayerCache", "SamplingConfig", "TokenOutput", "decode_step", "encode_media",
           "generate_tokens", "new_cache", "prefill", "prompt_lengths", "top_p_filter"]
