"""CUDA checks: grouped_mm dispatch under bf16 autocast vs the loop, the whole model's training
step on the auto attention backends. Skipped without CUDA.

Legend: B rows, S tokens, D dim.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mmtrain.models.attention import AttentionConfig
from mmtrain.models.decoder import DecoderConfig
from mmtrain.models.moe import MoE, MoEConfig
from mmtrain.models.moe.experts import resolve_path
from mmtrain.models.moe.grouped_mm import grouped_mm_supported
from mmtrain.models.multimodal import ModelConfig, MultimodalModel
from mmtrain.models.testing import IMAGE, VIDEO, pack, random_doc
from mmtrain.models.vision import VisionConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_grouped_mm_is_used_on_hopper() -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("grouped_mm needs sm90 here")
    assert grouped_mm_supported("cuda", torch.bfloat16)
    x = torch.zeros(1, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert resolve_path("auto", x).name == "grouped_mm"


@pytest.mark.parametrize("path", ["grouped_mm", "batched"])
def test_dispatch_matches_loop_under_bf16_autocast(path: str) -> None:
    if path == "grouped_mm" and not grouped_mm_supported("cuda", torch.bfloat16):
        pytest.skip("no grouped_mm on this GPU")
    cfg = MoEConfig(n_routed=32, top_k=4, n_shared=1, expert_dim=128, dispatch=path)
    fast = MoE(256, cfg).cuda()
    ref = copy.deepcopy(fast)
    ref.experts.path = "loop"
    x_BSD = torch.randn(2, 512, 256, device="cuda")
    g_BSD = torch.randn(2, 512, 256, device="cuda")
    grads = []
    for moe in (fast, ref):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y_BSD, aux = moe(x_BSD, None)
        (y_BSD.float() * g_BSD).sum().backward()
        grads.append([p.grad.float() for p in moe.parameters()])
        torch.cuda.synchronize()
        if moe is fast:
            y_fast = y_BSD.float()
    torch.testing.assert_close(y_fast, y_BSD.float(), atol=3e-2, rtol=3e-2)
    for g_f, g_r in zip(*grads):
        torch.testing.assert_close(g_f, g_r, atol=5e-2, rtol=5e-2)


def test_tiny_model_trains_a_step_on_cuda() -> None:
    moe = MoEConfig(n_routed=8, top_k=2, n_shared=1, expert_dim=128, first_dense_layers=1,
                    modality_groups=True, n_text_experts=4, n_visual_experts=4)
    cfg = ModelConfig(
        VisionConfig(patch_size=8, dim=96, depth=2, n_heads=4, abs_pos_grid=8),
        DecoderConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384,
                      mrope_sections=(4, 6, 6), layer_layout="FS",
                      attention=AttentionConfig(block_size=32, window=64, top_k=2), moe=moe),
    )
    model = MultimodalModel(cfg).cuda().train()
    P = cfg.vision.patch_dim
    rows = [[random_doc(512, P, 40, ((IMAGE, (1, 8, 8)),)), random_doc(512, P, 30)],
            [random_doc(512, P, 20, ((VIDEO, (2, 8, 8)), (IMAGE, (1, 4, 6))))]]
    inputs = {k: v.cuda() for k, v in pack(rows, 256, P).items()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(**inputs, capture_layers=[1])
        loss = out.logits_BSV.float().logsumexp(-1).mean() + sum(out.aux_losses.values())
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert "selection" in out.captures[1]
