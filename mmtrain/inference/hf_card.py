"""The model card (README.md) of an `mmtrain export --hf` folder: usage, architecture, the weight
spec (layouts, RoPE convention, routing formula, the sparse block rule) and the parity figures
measured at export."""

from __future__ import annotations

USAGE = """```python
from transformers import AutoModelForImageTextToText, AutoProcessor
proc = AutoProcessor.from_pretrained(DIR, trust_remote_code=True)
model = AutoModelForImageTextToText.from_pretrained(DIR, trust_remote_code=True)  # or AutoModelForCausalLM
inputs = proc(images=image, return_tensors="pt")          # no text: the caption prompt
new = model.generate(**inputs, max_new_tokens=32)[:, inputs["input_ids"].shape[1]:]
print(proc.batch_decode(new, skip_special_tokens=True))
```
With `text=`, each `<|image_pad|>` / `<|video_pad|>` in it marks where the next image / video goes;
`videos=` takes a (T, H, W, 3) uint8 clip (all its frames) with `video_fps=` its frame rate.
lm-evaluation-harness: `HFLM(pretrained=DIR, trust_remote_code=True, add_bos_token=True)`.
Attention runs `eager` or `sdpa` (a materialised mask); other implementations are refused, since
they would run the sparse layers as plain causal attention (serving: docs/EXPORT.md in mmtrain)."""


def model_card(hfc: dict, tensors: dict, src, figures: dict | None) -> str:
    n_params = sum(t.numel() for t in tensors.values())
    v = hfc["vision"]
    sparse = [i for i, t in enumerate(hfc["layer_types"]) if t == "mmtrain_sparse"]
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: image-text-to-text",
        "tags: [mmtrain, custom_code]",
        "---",
        "# mmtrain model",
        "",
        f"Exported by `mmtrain export --hf` from `{src}`: {n_params:,} parameters, fp32, "
        f"transformers {hfc['transformers_version_tested']} (remote code: the `*_mmtrain.py` files here).",
        "",
        "## Usage",
        "",
        USAGE,
        "",
        "## Architecture",
        "",
        f"- Vision: a ViT trained from scratch, {v['depth']} blocks of width {v['hidden_size']} "
        f"({v['num_heads']} heads, "
        f"QK-norm {v['qk_norm']}), tubelets of {v['temporal_patch']} x {v['patch_size']} x "
        f"{v['patch_size']} pixels "
        "(an image is one frame repeated), bidirectional attention inside each medium, axial (t, h, w) RoPE"
        + (f" plus a learned {v['abs_pos_grid']}-cell row + column embedding" if v["abs_pos_grid"] else "")
        + f", then each {v['spatial_merge_size']}x{v['spatial_merge_size']} patch neighbourhood -> one "
        "decoder token (a GELU MLP"
        + (", then an RMSNorm with a learned gain" if v.get("out_norm") else "")
        + ").",
        f"- Decoder: {hfc['num_hidden_layers']} pre-norm RMSNorm blocks of width {hfc['hidden_size']}, "
        f"{hfc['num_attention_heads']} query / {hfc['num_key_value_heads']} kv heads, QK-norm "
        f"{hfc['qk_norm']}, "
        f"M-RoPE sections (t, h, w) = {tuple(hfc['mrope_section'])} pairs, theta {hfc['rope_theta']}; sparse "
        f"attention in layers {sparse or 'none'}, full attention in the others; "
        + (
            f"MoE from layer {hfc['first_k_dense_replace']}: {hfc['n_routed_experts']} routed experts "
            f"(top {hfc['num_experts_per_tok']}, {hfc['scoring_func']} scores) + "
            f"{hfc['n_shared_experts']} shared, "
            f"width {hfc['moe_intermediate_size']}."
            if hfc["n_routed_experts"]
            else "dense SwiGLU FFNs."
        ),
        f"- Context: {hfc['max_position_embeddings']} tokens (what it was trained on).",
        "",
        "## Weight spec",
        "",
        "- Linear weights are (out, in). `self_attn.{q,k,v}_proj` are the q, k and v rows of mmtrain's "
        "fused `wqkv` (stored grouped by KV head); "
        "`mlp.{gate,up}_proj` the even and odd rows of its fused `w_in`; "
        "expert E's `gate_proj`/`up_proj` are the transposed "
        "halves of `w_in_EDF2[E]` (D, 2F) and `down_proj` the transposed `w_out_EFD[E]`; the vision "
        "blocks keep a "
        "fused `attn.qkv` (rows q | k | v, heads inside each)"
        + (
            "; `model.visual.merger.out_norm.weight` is the gain of the RMSNorm on the merger's output "
            f"(fp32, eps {v['rms_norm_eps']})"
            if v.get("out_norm")
            else ""
        )
        + ".",
        "- RoPE: rotate-half pairs (feature i with i + head_dim / 2), computed in fp32. Decoder "
        "M-RoPE: one ladder "
        "theta^(-i / F) over the F = head_dim / 2 pairs, cut into contiguous (t, h, w) sections; text has "
        "t = h = w = its position, a medium's token at merged cell (t, h, w) gets the running "
        "position + (t, h, w), "
        "after which the position advances by max(t, h, w). Vision: each axis its own ladder over "
        "its section.",
        "- Routing (fp32): s = sigmoid(x W_gate^T) (or softmax); top-k on s + "
        "`e_score_correction_bias` (selection "
        "only); weights = the chosen s, normalised to sum 1 for sigmoid, times routed_scaling_factor; "
        "y = sum_k w_k expert_k(x) + shared(x); padding is not routed.",
        f"- Sparse block rule (block size {hfc['sparse_block_size']}, counted from the document's "
        "first token): a "
        f"query keeps its own block (causal inside), the blocks within a {hfc['sparse_window']}-token "
        "window before "
        f"it, {'block 0 (sink), ' if hfc['sparse_sink'] else ''}"
        f"{'every earlier block holding a visual token, ' if hfc['sparse_visual_always'] else ''}the "
        "blocks of its "
        f"own image / video frame, and the top {hfc['sparse_top_k']} of the other completed earlier "
        "blocks, scored "
        "by q . mean(k over the block) in fp32 (q: "
        f"{'the previous block mean query' if hfc['sparse_select'] == 'block' else 'the token own query'}, "
        f"per {hfc['sparse_select_per']}). Inside kept blocks: the token rule (causal; an image or a "
        "video frame "
        "bidirectional). The cache keeps every block's mean key.",
        "",
        "## Parity with mmtrain (measured at export)",
        "",
    ]
    if figures is None:
        lines.append("Not measured: transformers was not installed where the export ran.")
    else:
        lines += [
            f"{figures['prompts']}; {figures['dtype']} on {figures['device']}, transformers "
            f"{figures['transformers']}:",
            "",
            "| check | result |",
            "|---|---|",
            f"| max abs logit difference, eager | {figures['max_abs_logit_diff_eager']:.2e} |",
            f"| max abs logit difference, sdpa | {figures['max_abs_logit_diff_sdpa']:.2e} |",
            f"| greedy `generate` ({figures['new_tokens']} tokens) gives mmtrain's text | "
            f"{'yes' if figures['greedy_text_equal'] else 'NO'} |",
        ]
    return "\n".join(lines) + "\n"
