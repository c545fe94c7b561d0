"""mmtrain state dict <-> the HF classes' names and layouts (not copied into exports; torch only).

Every tensor is a slice, transpose or copy of one mmtrain tensor, so the round trip is exact:
  decoder.layers.N.attn.wqkv (rows per KV group) -> model.language_model.layers.N.self_attn.{q,k,v}_proj
  decoder.layers.N.ffn.w_in (rows gate, up a unit) -> mlp.{gate,up}_proj (dense layers, shared experts)
  ffn experts w_in_EDF2 (E, D, 2F: gate | up)     -> mlp.experts.E.{gate,up}_proj.weight (F, D): transposed
  ffn experts w_out_EFD (E, F, D)                 -> mlp.experts.E.down_proj.weight (D, F): transposed
  ffn router weight / expert bias (fp32)          -> mlp.gate.weight / mlp.gate.e_score_correction_bias
  vision.blocks.N.attn.wqkv (rows per head)      -> model.visual.blocks.N.attn.qkv (rows q | k | v, as
                                                     Qwen2-VL's)
(mmtrain's fused rows are grouped so that a contiguous block is whole heads / units: models/self_attention.py,
models/ffn.py; `_to_blocks` reorders them into HF's row blocks and `_from_blocks` back.)
  vision.projector.w_{in,out}, vision.out_norm    -> model.visual.merger.mlp.fc{1,2}, merger.out_norm
The MoE's names changed when it was split into router / experts modules (`ffn.expert_bias_E` ->
`ffn.router.expert_bias_E`, `ffn.w_in_EDF2` -> `ffn.experts.w_in_EDF2`): the patterns below read
both spellings, and `from_hf` writes the one its target state dict uses.
Training-only tensors (the masked-patch head and mask token, the decoder-side visual head of
loss.visual_next) are not exported: nothing at inference reads them, so parity is unaffected.

Legend: E experts, D model dim, F expert hidden dim, H heads, K kv heads, Eh head dim.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from mmtrain.models.self_attention import qkv_order

Tensor = torch.Tensor
OUT_NORM = "vision.out_norm.weight"
TRAINING_ONLY = ("vision.mask_token", "vision.ssl_head.weight", "vision.ssl_head.bias",
                 "visual_head.weight", "visual_head.bias")
_SIMPLE = [  # (mmtrain pattern, HF pattern): renamed, same tensor
    (r"decoder\.embed\.weight", "model.language_model.embed_tokens.weight"),
    (r"decoder\.norm\.weight", "model.language_model.norm.weight"),
    (r"decoder\.lm_head\.weight", "lm_head.weight"),
    (r"decoder\.layers\.(\d+)\.attn_norm\.weight", r"model.language_model.layers.\1.input_layernorm.weight"),
    (
        r"decoder\.layers\.(\d+)\.ffn_norm\.weight",
        r"model.language_model.layers.\1.post_attention_layernorm.weight",
    ),
    (r"decoder\.layers\.(\d+)\.attn\.wo\.weight", r"model.language_model.layers.\1.self_attn.o_proj.weight"),
    (
        r"decoder\.layers\.(\d+)\.attn\.(q|k)_norm\.weight",
        r"model.language_model.layers.\1.self_attn.\2_norm.weight",
    ),
    (r"decoder\.layers\.(\d+)\.ffn\.w_out\.weight", r"model.language_model.layers.\1.mlp.down_proj.weight"),
    (r"decoder\.layers\.(\d+)\.ffn\.router\.weight", r"model.language_model.layers.\1.mlp.gate.weight"),
    (
        r"decoder\.layers\.(\d+)\.ffn\.(?:router\.)?expert_bias_E",
        r"model.language_model.layers.\1.mlp.gate.e_score_correction_bias",
    ),
    (
        r"decoder\.layers\.(\d+)\.ffn\.shared\.w_out\.weight",
        r"model.language_model.layers.\1.mlp.shared_experts.down_proj.weight",
    ),
    (r"vision\.patch_embed\.(weight|bias)", r"model.visual.patch_embed.proj.\1"),
    (r"vision\.(row|col)_embed", r"model.visual.\1_embed"),
    (r"vision\.norm\.weight", "model.visual.norm.weight"),
    (r"vision\.projector\.w_in\.weight", "model.visual.merger.mlp.fc1.weight"),
    (r"vision\.projector\.w_out\.weight", "model.visual.merger.mlp.fc2.weight"),
    (r"vision\.out_norm\.weight", "model.visual.merger.out_norm.weight"),  # vision.out_norm: true only
    (r"vision\.blocks\.(\d+)\.attn_norm\.weight", r"model.visual.blocks.\1.norm1.weight"),
    (r"vision\.blocks\.(\d+)\.mlp_norm\.weight", r"model.visual.blocks.\1.norm2.weight"),
    (r"vision\.blocks\.(\d+)\.attn\.wo\.weight", r"model.visual.blocks.\1.attn.proj.weight"),
    (r"vision\.blocks\.(\d+)\.attn\.(q|k)_norm\.weight", r"model.visual.blocks.\1.attn.\2_norm.weight"),
    (r"vision\.blocks\.(\d+)\.mlp\.w_in\.weight", r"model.visual.blocks.\1.mlp.fc1.weight"),
    (r"vision\.blocks\.(\d+)\.mlp\.w_out\.weight", r"model.visual.blocks.\1.mlp.fc2.weight"),
]
_SPLIT = [  # (mmtrain pattern, HF prefix, part names): row blocks of one tensor ("f": one fused block)
    (r"vision\.blocks\.(\d+)\.attn\.wqkv\.weight", r"model.visual.blocks.\1.attn.", "f"),
    (r"decoder\.layers\.(\d+)\.attn\.wqkv\.weight", r"model.language_model.layers.\1.self_attn.", "qkv"),
    (r"decoder\.layers\.(\d+)\.ffn\.w_in\.weight", r"model.language_model.layers.\1.mlp.", "gu"),
    (
        r"decoder\.layers\.(\d+)\.ffn\.shared\.w_in\.weight",
        r"model.language_model.layers.\1.mlp.shared_experts.",
        "gu",
    ),
]
_EXPERTS = r"decoder\.layers\.(\d+)\.ffn\.(?:experts\.)?(w_in_EDF2|w_out_EFD)"
_PART = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "g": "gate_proj", "u": "up_proj", "f": "qkv"}


def to_hf(state: dict[str, Tensor], hfc: dict) -> dict[str, Tensor]:
    """mmtrain names -> HF names (`hfc`: the HF config dict). ValueError names a tensor it cannot place."""
    _check_out_norm(state, hfc)
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if name in TRAINING_ONLY or (name == "decoder.lm_head.weight" and hfc.get("tie_word_embeddings")):
            continue
        kind, targets = _targets(name, hfc)
        if kind == "same":
            out[targets[0]] = t
        elif kind == "rows":
            t = _to_blocks(name, t, hfc)
            sizes = _rows(hfc, len(targets), t.shape[0])
            out.update(zip(targets, t.split(sizes)))
        elif name.endswith("w_out_EFD"):
            out.update(zip(targets, (w.t() for w in t)))
        else:  # w_in_EDF2: the gate half then the up half of every expert, transposed
            gate_EFD, up_EFD = (h.transpose(1, 2) for h in t.chunk(2, dim=-1))
            out.update(zip(targets, [*gate_EFD, *up_EFD]))
    return out


def from_hf(hf: dict[str, Tensor], hfc: dict, names: Iterable[str]) -> dict[str, Tensor]:
    """HF names -> the mmtrain state dict whose keys are `names` (either MoE spelling)."""
    out: dict[str, Tensor] = {}
    for name in names:
        if name in TRAINING_ONLY:
            continue
        if name == "decoder.lm_head.weight" and hfc.get("tie_word_embeddings"):
            out[name] = hf["model.language_model.embed_tokens.weight"]
            continue
        kind, targets = _targets(name, hfc)
        parts = [hf[k] for k in targets]
        if kind == "same":
            out[name] = parts[0]
        elif kind == "rows":
            out[name] = _from_blocks(name, torch.cat(parts), hfc)
        elif name.endswith("w_out_EFD"):
            out[name] = torch.stack([w.t() for w in parts])
        else:
            E = len(parts) // 2
            out[name] = torch.stack([torch.cat([parts[e].t(), parts[E + e].t()], -1) for e in range(E)])
    return out


def _heads(name: str, hfc: dict) -> tuple[int, int, int]:
    """(H, K, head dim) of the attention a fused wqkv belongs to."""
    if name.startswith("vision."):
        v = hfc["vision"]
        return v["num_heads"], v["num_heads"], v["hidden_size"] // v["num_heads"]
    H = hfc["num_attention_heads"]
    return H, hfc["num_key_value_heads"], hfc["hidden_size"] // H


def _order(name: str, hfc: dict, rows: int) -> Tensor:
    """Row indices taking mmtrain's grouped rows to HF's blocks: [q | k | v] or [gate | up]."""
    if name.endswith("attn.wqkv.weight"):
        return qkv_order(*_heads(name, hfc))
    return torch.arange(rows).view(-1, 2).t().reshape(-1)  # gate, up per unit -> gate | up


def _to_blocks(name: str, t: Tensor, hfc: dict) -> Tensor:
    return t[_order(name, hfc, t.shape[0]).to(t.device)]


def _from_blocks(name: str, t: Tensor, hfc: dict) -> Tensor:
    return t[_order(name, hfc, t.shape[0]).argsort().to(t.device)]


def _rows(hfc: dict, n_parts: int, total: int) -> list[int]:
    if n_parts == 1:  # one fused block (the vision blocks' qkv)
        return [total]
    if n_parts == 2:  # gate | up
        return [total // 2, total // 2]
    E = hfc["hidden_size"] // hfc["num_attention_heads"]
    kv = hfc["num_key_value_heads"] * E
    return [hfc["num_attention_heads"] * E, kv, kv]


def _check_out_norm(state: dict[str, Tensor], hfc: dict) -> None:
    """The config's vision out_norm and the state must agree, else the HF classes would load with the
    gain unused (or left at 1) and their visual tokens would not be mmtrain's."""
    has, on = OUT_NORM in state, bool((hfc.get("vision") or {}).get("out_norm"))
    if has != on:
        raise ValueError(
            f"{OUT_NORM}: {'present' if has else 'missing'} but the config's vision.out_norm "
            f"is {str(on).lower()}"
        )


def _targets(name: str, hfc: dict) -> tuple[str, list[str]]:
    """("same" | "rows" | "experts", the HF names the tensor becomes, in order)."""
    for pat, repl in _SIMPLE:
        if re.fullmatch(pat, name):
            return "same", [re.sub(pat, repl, name)]
    for pat, prefix, parts in _SPLIT:
        if re.fullmatch(pat, name):
            base = re.sub(pat, prefix, name)
            return "rows", [f"{base}{_PART[p]}.weight" for p in parts]
    m = re.fullmatch(_EXPERTS, name)
    if m:
        base, E = f"model.language_model.layers.{m[1]}.mlp.experts.", hfc["n_routed_experts"]
        projs = ("down_proj",) if m[2] == "w_out_EFD" else ("gate_proj", "up_proj")
        return "experts", [f"{base}{e}.{p}.weight" for p in projs for e in range(E)]
    raise ValueError(f"{name}: a tensor the HF classes have no place for (an architecture change?)")
