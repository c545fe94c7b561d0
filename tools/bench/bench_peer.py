"""mmtrain against the peer a user would pick: Hugging Face transformers' Qwen3-VL-MoE at equal
dimensions, trained side by side in one process (steps interleaved), on random weights.

    pip install 'mmtrain[bench]'         # transformers (benchmark-only extra)
    python -m tools.bench.bench_peer --seq 1024 4096 --steps 6 --rounds 2 --threads 2 --compile

Both models: decoder width 256, 4 layers, 4 heads / 2 kv heads (head dim 64), an MoE FFN in
every layer (8 experts, top-2, expert width 256, no shared expert), vocabulary 4096, a 2-block
ViT of width 128 with patch 8 (temporal patch 2, 2x2 merge); one sequence of `seq` tokens holding
one document with 2 images of 64x64 pixels (16 decoder tokens each). fp32, fused AdamW on both sides
(Hugging Face Trainer's default optimizer with torch >= 2.8, and mmtrain's). A step =
forward + cross-entropy (+ the models' own MoE auxiliary losses) + backward + optimizer step.
mmtrain runs with every layer full ("F") and with the F/S layout (full, sparse, ...; the default
sparse rule: block 64, window 256, sink, top-4 by the previous block's mean query); with
`--layouts long` the long-context layout (FSSS: one full layer in four; window 1024, top-8
blocks of 64, visual blocks kept); with `--compile` also with every vision block and decoder
layer compiled by Inductor, as
`dist.compile: true` does (the compile happens in the warm-up steps, not timed).

Nothing is downloaded: the peer is built from a config. Its attention is causal over all tokens
(Qwen3-VL has no bidirectional image spans) through SDPA. MFU: the model FLOPs per token that
`tools.bench.bench_model` counts (models.counting, with the keys each layer attended on the
batch; the peer is counted as mmtrain's all-full model) x tokens/s / the fp32 matmul peak measured
in the same run. Medians over every timed step of every round; wall time and the process's CPU
time (CPU time is the steadier one on a shared machine; with 2 threads it counts both).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from mmtrain.models import AttentionConfig, DecoderConfig, ModelConfig, MoEConfig, MultimodalModel
from mmtrain.models.testing import IMAGE, pack, random_doc
from mmtrain.models.vision import VisionConfig
from mmtrain.parallel.parallelize import block_lists
from tools.bench.bench_model import matmul_peak

DIM, LAYERS, HEADS, KV_HEADS, EXPERTS, TOP_K, EXPERT_DIM, VOCAB = 256, 4, 4, 2, 8, 2, 256, 4096
VIT_DIM, VIT_DEPTH, VIT_HEADS, PATCH, GRID = 128, 2, 4, 8, 8  # an image: 8x8 patches -> 16 tokens
IMAGE_ID, VIDEO_ID, START_ID, END_ID = VOCAB - 4, VOCAB - 3, VOCAB - 2, VOCAB - 1


# A named layout: (layer_layout, attention overrides). "long": one full layer in four, the sparse
# layers with window 1024, top-8 blocks of 64 and every earlier visual block kept.
LAYOUTS = {"long": ("FSSS", {"window": 1024, "top_k": 8, "visual_always": True})}


def mmtrain_model(layout: str, backend: str = "auto") -> MultimodalModel:
    layout, knobs = LAYOUTS.get(layout, (layout, {}))
    cfg = ModelConfig(
        vision=VisionConfig(patch_size=PATCH, temporal_patch=2, merge=2, dim=VIT_DIM, depth=VIT_DEPTH,
                            n_heads=VIT_HEADS),
        decoder=DecoderConfig(vocab_size=VOCAB, dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS,
                              mrope_sections=(8, 12, 12), layer_layout=layout,
                              attention=AttentionConfig(backend=backend, **knobs),
                              moe=MoEConfig(n_routed=EXPERTS, top_k=TOP_K, n_shared=0, expert_dim=EXPERT_DIM,
                                            first_dense_layers=0)))
    return MultimodalModel(cfg).train()


def mmtrain_batch(seq: int) -> dict:
    P = 3 * 2 * PATCH * PATCH
    n_text = (seq - 2 * GRID * GRID // 4) // 2 - 1
    doc = random_doc(VOCAB, P, n_text, ((IMAGE, (1, GRID, GRID)), (IMAGE, (1, GRID, GRID))))
    return pack([[doc]], seq, P)


def peer_model():
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    cfg = Qwen3VLMoeConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=4 * DIM,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=DIM // HEADS,
                         moe_intermediate_size=EXPERT_DIM, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                         decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [8, 12, 12], "mrope_interleaved": True}),
        vision_config=dict(depth=VIT_DEPTH, hidden_size=VIT_DIM, intermediate_size=4 * VIT_DIM,
                           num_heads=VIT_HEADS, patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=2,
                           out_hidden_size=DIM, deepstack_visual_indexes=[],
                           num_position_embeddings=GRID * GRID),
        image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=START_ID,
        vision_end_token_id=END_ID, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    cfg.text_config.output_router_logits = True  # its load-balancing loss, as mmtrain's aux losses
    return Qwen3VLMoeForConditionalGeneration(cfg).train()


def peer_batch(seq: int) -> dict:
    n_img = GRID * GRID // 4
    n_text = (seq - 2 * (n_img + 2)) // 3
    text = [torch.randint(0, VOCAB - 4, (n,)) for n in (n_text, n_text, seq - 2 * (n_img + 2) - 2 * n_text)]
    img = torch.tensor([START_ID] + [IMAGE_ID] * n_img + [END_ID])
    ids = torch.cat([text[0], img, text[1], img, text[2]])[None]
    return dict(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids),
                mm_token_type_ids=(ids == IMAGE_ID).int(),  # 1 = image token (what its processor returns)
                pixel_values=torch.randn(2 * GRID * GRID, 3 * 2 * PATCH * PATCH),
                image_grid_thw=torch.tensor([[1, GRID, GRID]] * 2))


def mmtrain_step(model: MultimodalModel, opt, batch: dict) -> None:
    out = model(**batch)
    labels_BS = batch["tokens_BS"].roll(-1, dims=1)
    loss = F.cross_entropy(out.logits_BSV.flatten(0, 1).float(), labels_BS.flatten())
    (loss + sum(out.aux_losses.values())).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.update_moe_bias()


def peer_step(model, opt, batch: dict) -> None:
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def flops_per_token(model: MultimodalModel, batch: dict, seq: int) -> float:
    with torch.no_grad():
        stats = model(**batch, attn_stats=True, compute_logits=False).attn_stats
    keys = {i: float(st["keys"] / st["tokens"]) for i, st in stats.items()}
    vis = float((batch["modality_BS"] != 0).float().mean())
    ppm = batch["patches_NP"].shape[0] / max(batch["grid_thw_M3"].shape[0], 1)
    return model.flops_per_token(seq, vis, int(ppm), keys)


def run_seq(seq: int, args) -> list[dict]:
    """Interleaved steps of every side at one sequence length -> rows of the table."""
    torch._dynamo.reset()  # compile afresh per length: a second length would make the graphs dynamic
    sides = {}
    for layout in args.layouts:
        for compiled in (False, True) if args.compile else (False,):
            torch.manual_seed(0)
            model = mmtrain_model(layout, args.backend)
            batch = mmtrain_batch(seq)
            flops = flops_per_token(model, batch, seq)
            if compiled:  # as dist.compile applies it (mmtrain/parallel/parallelize.py): every block
                for blocks in block_lists(model):
                    for i, block in enumerate(blocks):
                        blocks[i] = torch.compile(block)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            name = f"mmtrain {layout}" + (" compiled" if compiled else "")
            sides[name] = (model, opt, batch, mmtrain_step, flops)
    if not args.no_peer:
        torch.manual_seed(0)
        model = peer_model()
        flops = sides["mmtrain F"][4] if "mmtrain F" in sides else float("nan")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        sides["transformers Qwen3-VL-MoE"] = (model, opt, peer_batch(seq), peer_step, flops)
    wall = {k: [] for k in sides}
    cpu = {k: [] for k in sides}
    for model, opt, batch, step, _ in sides.values():  # warm-up
        for _ in range(args.warmup):
            step(model, opt, batch)
    for _ in range(args.rounds):
        for name, (model, opt, batch, step, _) in sides.items():
            for _ in range(args.steps):
                t0, c0 = time.perf_counter(), time.process_time()
                step(model, opt, batch)
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    peak = matmul_peak(torch.device("cpu"), torch.float32, args.peak_n)
    rows = []
    for name, side in sides.items():
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        rows.append(dict(seq=seq, side=name, tps=seq / w, cpu_tps=seq / c, flops=side[4],
                         mfu=side[4] * seq / w / peak, peak=peak))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--layouts", nargs="+", default=["F", "FS"],
                    help="mmtrain layer layouts (F, FS, ..., or long: FSSS with window 1024, top-8)")
    ap.add_argument("--backend", default="auto", help="mmtrain attention backend")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per side per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peak-n", type=int, default=2048)
    ap.add_argument("--compile", action="store_true", help="also mmtrain with its blocks compiled (inductor)")
    ap.add_argument("--no-peer", action="store_true", help="mmtrain only (transformers not installed)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, {args.threads} threads, fp32, fused AdamW; medians of {args.steps} "
          f"steps x {args.rounds} rounds, interleaved")
    print("| seq | side | tokens/s (wall) | vs peer | tokens/s (CPU time) | vs peer | GFLOP/token | MFU |")
    print("|---|---|---|---|---|---|---|---|")
    for seq in args.seq:
        rows = run_seq(seq, args)
        peer = next((r for r in rows if r["side"].startswith("transformers")), None)
        for r in rows:
            vs = f"{r['tps'] / peer['tps']:.2f}x" if peer else "-"
            vs_cpu = f"{r['cpu_tps'] / peer['cpu_tps']:.2f}x" if peer else "-"
            print(f"| {seq:,} | {r['side']} | {r['tps']:,.0f} | {vs} | {r['cpu_tps']:,.0f} | {vs_cpu} | "
                  f"{r['flops'] / 1e9:.4f} | {r['mfu']:.1%} |", flush=True)
    print(f"# matmul peak (fp32, {args.peak_n}^3, same run): {rows[0]['peak'] / 1e12:.3f} TFLOP/s")


if __name__ == "__main__":
    main()
