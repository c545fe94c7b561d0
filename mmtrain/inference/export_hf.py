"""`mmtrain export --hf CKPT --out DIR`: a folder that Hugging Face transformers loads and runs as mmtrain.

DIR gets config.json (with auto_map, the special-token ids and the tested transformers range),
safetensors under the HF classes' names (one file, or shards + model.safetensors.index.json),
the HF classes themselves (mmtrain/hf/REMOTE_FILES: remote code), tokenizer files
(PreTrainedTokenizerFast; BOS added, as every mmtrain document starts with it), the processor's
configs with a chat template rendering mmtrain's document layout, generation_config.json (greedy;
the special ids mmtrain's generate bans are suppressed) and README.md, the model card with the
weight spec and the parity figures measured at export (`parity.py`; skipped when transformers is
not installed). No transformers is needed to write it. Written next to DIR and renamed into place.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from mmtrain.data_pipelines.tokenizer import SPECIAL_TOKENS, load_tokenizer
from mmtrain.errors import UserError
from mmtrain.hf import REMOTE_FILES
from mmtrain.hf.convert import to_hf
from mmtrain.inference.hf_card import model_card
from mmtrain.inference.loading import clean_state_dict
from mmtrain.state.checkpoint import load_for_inference, swap_in, tokenizer_file
from mmtrain.state.export import resolve_checkpoint
from mmtrain.state.export import run as run_mmtrain_export

HF_DIR = Path(__file__).parents[1] / "hf"  # mmtrain/hf/
TRANSFORMERS_RANGE = ">=5.24,<6"  # tested with 5.24 (tests/mmtrain/test_hf_*.py)
INDEX_FILE = "model.safetensors.index.json"
SPECIAL_KEYS = ("pad", "bos", "eos", "image_start", "image_end", "image", "video_start", "video_end", "video")
CHAT_TEMPLATE = (  # mmtrain has no roles: the messages' contents in order, media as their placeholders
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|image_pad|>{% elif part['type'] == 'video' %}<|video_pad|>"
    "{% endif %}{% endfor %}{% endif %}{% endfor %}"
)


def hf_config(cfg: dict, vocab_size: int, special: dict[str, int]) -> dict:
    """The HF config (configuration_mmtrain.MmtrainConfig's fields) of a resolved run config."""
    dec, vis, att = cfg["model"]["decoder"], cfg["model"]["vision"], cfg["model"]["decoder"]["attention"]
    moe = dec.get("moe")
    layout = dec["layer_layout"]
    out = {
        "architectures": ["MmtrainForConditionalGeneration"],
        "model_type": "mmtrain",
        "auto_map": {
            "AutoConfig": "configuration_mmtrain.MmtrainConfig",
            "AutoModel": "modeling_mmtrain.MmtrainModel",
            "AutoModelForCausalLM": "modeling_mmtrain.MmtrainForConditionalGeneration",
            "AutoModelForImageTextToText": "modeling_mmtrain.MmtrainForConditionalGeneration",
        },
        "transformers_version_tested": TRANSFORMERS_RANGE,
        "dtype": "float32",
        "vocab_size": vocab_size,
        "hidden_size": dec["dim"],
        "num_hidden_layers": dec["n_layers"],
        "num_attention_heads": dec["n_heads"],
        "num_key_value_heads": dec["n_kv_heads"],
        "intermediate_size": dec["ffn_dim"],
        "rope_theta": dec["rope_theta"],
        "mrope_section": list(dec["mrope_sections"]),
        "qk_norm": dec["qk_norm"],
        "rms_norm_eps": dec["norm_eps"],
        "tie_word_embeddings": dec["tie_embeddings"],
        "max_position_embeddings": cfg["data"]["seq_len"],
        "layer_types": [
            "mmtrain_sparse" if layout[i % len(layout)] == "S" else "mmtrain_full"
            for i in range(dec["n_layers"])
        ],
        "sparse_block_size": att["block_size"],
        "sparse_window": att["window"],
        "sparse_top_k": att["top_k"],
        "sparse_sink": att["sink"],
        "sparse_visual_always": att["visual_always"],
        "sparse_select": att["select"],
        "sparse_select_per": att["select_per"],
        "n_routed_experts": moe["n_routed"] if moe else 0,
        "vision": {
            "patch_size": vis["patch_size"],
            "temporal_patch": vis["temporal_patch"],
            "in_channels": vis["in_channels"],
            "hidden_size": vis["dim"],
            "depth": vis["depth"],
            "num_heads": vis["n_heads"],
            "intermediate_size": int(vis["mlp_ratio"] * vis["dim"]),
            "spatial_merge_size": vis["merge"],
            "rope_theta": vis["rope_theta"],
            "qk_norm": vis["qk_norm"],
            "rms_norm_eps": vis["norm_eps"],
            "abs_pos_grid": vis["abs_pos_grid"],
            "out_norm": vis.get("out_norm", False),  # absent from checkpoints older than the flag
        },
        **{f"{k}_token_id": special[k] for k in SPECIAL_KEYS},
    }
    if moe:
        out.update(
            {
                "num_experts_per_tok": moe["top_k"],
                "n_shared_experts": moe["n_shared"],
                "moe_intermediate_size": moe["expert_dim"],
                "scoring_func": moe["score"],
                "routed_scaling_factor": moe["route_scale"],
                "first_k_dense_replace": moe["first_dense_layers"],
                "modality_groups": moe["modality_groups"],
                "n_text_experts": moe["n_text_experts"],
            }
        )
    return out


def export_hf(ckpt: str | Path, out: str | Path, max_shard_mib: float = 4096, parity: bool = True) -> Path:
    from safetensors.torch import save_file

    src, out = resolve_checkpoint(ckpt), Path(out)
    config, state, tok_path = load_for_inference(src)
    tok_path = tok_path or tokenizer_file((config.get("data") or {}).get("tokenizer"))
    if tok_path is None:
        raise UserError(f"{src}: no tokenizer.json (the byte tokenizer has no Hugging Face form)")
    tok = load_tokenizer(tok_path)
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or _is_hf_export(out))):
        raise UserError(f"--out {out}: exists and is not an HF export (refusing to replace it)")
    special = dict(zip(SPECIAL_KEYS, tok.special.as_tuple()))
    state = clean_state_dict(state)
    vocab = state["decoder.embed.weight"].shape[0]
    hfc = hf_config(config, vocab, special)
    if config["model"]["vision"].get("out_center"):  # an experiment's arm, not in the HF classes
        raise UserError(f"{src}: vision.out_center has no Hugging Face form (export without --hf)")
    try:
        tensors = {k: v.detach().cpu().contiguous() for k, v in to_hf(state, hfc).items()}
    except ValueError as e:
        raise UserError(f"{src}: cannot export to the HF classes: {e}") from None
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    _write_json(tmp / "config.json", hfc)
    files = _shards(tensors, max_shard_mib)
    for name, shard in files.items():
        save_file(shard, tmp / name, metadata={"format": "pt"})
    if len(files) > 1:
        _write_index(tmp, files)
    _write_tokenizer(tmp, tok, config["data"]["seq_len"])
    _write_processor(tmp, config["data"]["media"])
    _write_json(tmp / "generation_config.json", _generation_config(special))
    for f in REMOTE_FILES:
        shutil.copyfile(HF_DIR / f, tmp / f)
    figures = None
    if parity:
        from mmtrain.inference.hf_parity import measure

        figures = measure(src, tmp)
    (tmp / "README.md").write_text(model_card(hfc, tensors, src, figures), encoding="utf-8")
    for f in tmp.iterdir():
        f.chmod(0o644)
    tmp.chmod(0o755)
    swap_in(tmp, out)
    return out


def run(args: argparse.Namespace) -> int:
    """`mmtrain export` (arguments: export.add_arguments): this folder with --hf, else mmtrain's own."""
    if not args.hf:
        return run_mmtrain_export(args)
    if args.max_shard_mib <= 0:
        raise UserError(f"--max-shard-mib: must be > 0 (got {args.max_shard_mib})")
    out = export_hf(args.checkpoint, args.out, args.max_shard_mib, parity=not args.no_parity)
    print(f"exported {resolve_checkpoint(args.checkpoint)} -> {out} (Hugging Face transformers)")
    return 0


def _is_hf_export(path: Path) -> bool:
    try:
        return json.loads((path / "config.json").read_text())["model_type"] == "mmtrain"
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def _shards(tensors: dict, max_mib: float) -> dict[str, dict]:
    """File name -> tensors: one model.safetensors, or numbered shards of at most max_mib (+ the index)."""
    shards, size, limit = [{}], 0, max_mib * 2**20
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        return {"model.safetensors": shards[0]}
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    return dict(zip(names, shards))


def _write_index(tmp: Path, files: dict[str, dict]) -> None:
    total = sum(t.numel() * t.element_size() for shard in files.values() for t in shard.values())
    weight_map = {k: name for name, shard in files.items() for k in shard}
    _write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_tokenizer(tmp: Path, tok, seq_len: int) -> None:
    from tokenizers import processors

    names = dict(zip(SPECIAL_KEYS, SPECIAL_TOKENS))
    bos = names["bos"]
    tok.hf.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.special.bos)]
    )
    tok.save(tmp / "tokenizer.json")
    _write_json(
        tmp / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": names["bos"],
            "eos_token": names["eos"],
            "pad_token": names["pad"],
            "split_special_tokens": True,  # "<|eos|>" written in a text is text, as in mmtrain
            "clean_up_tokenization_spaces": False,
            "model_max_length": seq_len,
            "padding_side": "left",
            "extra_special_tokens": [names[k] for k in SPECIAL_KEYS[3:]],
            "processor_class": "MmtrainProcessor",
            "auto_map": {"AutoProcessor": "processing_mmtrain.MmtrainProcessor"},
        },
    )


def _write_processor(tmp: Path, media: dict) -> None:
    _write_json(
        tmp / "preprocessor_config.json",
        {
            "image_processor_type": "MmtrainImageProcessor",
            "processor_class": "MmtrainProcessor",
            "auto_map": {
                "AutoImageProcessor": "image_processing_mmtrain.MmtrainImageProcessor",
                "AutoProcessor": "processing_mmtrain.MmtrainProcessor",
            },
            "patch_size": media["patch_size"],
            "temporal_patch_size": media["temporal_patch"],
            "merge_size": media["merge"],
            "min_pixels": media["min_pixels"],
            "max_pixels": media["max_pixels"],
            "video_fps": media["video_fps"],
            "video_min_frames": media["video_min_frames"],
            "video_max_frames": media["video_max_frames"],
            "image_mean": list(media["mean"]),
            "image_std": list(media["std"]),
        },
    )
    _write_json(
        tmp / "processor_config.json",
        {
            "processor_class": "MmtrainProcessor",
            "auto_map": {"AutoProcessor": "processing_mmtrain.MmtrainProcessor"},
        },
    )
    (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def _generation_config(special: dict[str, int]) -> dict:
    banned = [i for k, i in special.items() if k != "eos"]
    return {
        "do_sample": False,
        "bos_token_id": special["bos"],
        "eos_token_id": special["eos"],
        "pad_token_id": special["pad"],
        "suppress_tokens": sorted(set(banned)),
    }
