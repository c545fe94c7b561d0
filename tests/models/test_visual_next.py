"""Next visual token prediction (models/visual_next.py, ModelConfig.visual_head): the fast index
mapping equals the loop over media on random packed batches (images of several grids, videos,
one-token media); the last token of a medium has no target; a medium's targets are its own pixels
only; targets are normalised per token; the model without the head is unchanged; the head learns.

Legend: B rows, S tokens, N patches, P patch dim, M media, K tokens with a target, T values each.
"""

from __future__ import annotations

import pytest
import torch

from mmtrain.models.attention import AttentionConfig
from mmtrain.models.decoder import DecoderConfig
from mmtrain.models.multimodal import ModelConfig, MultimodalModel
from mmtrain.models.testing import IMAGE, VIDEO, pack, random_doc
from mmtrain.models.vision import VisionConfig
from mmtrain.models.visual_next import (
    merged_pixels,
    next_pairs,
    next_targets,
    next_targets_reference,
    predicting_positions,
)

MERGE = 2
V = 100
GRIDS = [(IMAGE, (1, 4, 6)), (IMAGE, (1, 2, 2)), (IMAGE, (1, 6, 4)), (VIDEO, (3, 4, 4)), (VIDEO, (2, 2, 6))]


def _random_batch(gen: torch.Generator, rows: int = 3, seq: int = 96, patch_dim: int = 12):
    """-> (modality_BS, media_ids_BS, patches_NP, grid_thw_M3): media at random places, text between,
    numbered in row-major placeholder order (the packed batch's rule)."""
    modality_BS = torch.zeros(rows, seq, dtype=torch.int8)
    media_ids_BS = torch.full((rows, seq), -1, dtype=torch.int32)
    grids = []
    for b in range(rows):
        s = int(torch.randint(0, 4, (1,), generator=gen))
        while True:
            kind, grid = GRIDS[int(torch.randint(len(GRIDS), (1,), generator=gen))]
            n = grid[0] * grid[1] * grid[2] // MERGE ** 2
            if s + n > seq:
                break
            modality_BS[b, s:s + n], media_ids_BS[b, s:s + n] = kind, len(grids)
            grids.append(grid)
            s += n + int(torch.randint(0, 5, (1,), generator=gen))  # text (or none) after it
    grid_M3 = torch.tensor(grids, dtype=torch.long).view(-1, 3)
    patches_NP = torch.randn(int(grid_M3.prod(-1).sum()), patch_dim, generator=gen)
    return modality_BS, media_ids_BS, patches_NP, grid_M3


@pytest.mark.parametrize("seed", range(6))
def test_the_fast_mapping_equals_the_loop_over_media(seed):
    modality_BS, media_ids_BS, patches_NP, grid_M3 = _random_batch(torch.Generator().manual_seed(seed))
    assert (grid_M3[:, 0] > 1).any() and len(grid_M3) > 3  # a video, several media
    ref = next_targets_reference(media_ids_BS, patches_NP, grid_M3, MERGE)
    b_K, s_K = predicting_positions(modality_BS, grid_M3, MERGE)
    target_KT = next_targets(patches_NP, grid_M3, MERGE, normalize=False)
    assert [(b, s) for b, s, _ in ref] == list(zip(b_K.tolist(), s_K.tolist()))
    assert torch.equal(torch.stack([t for _, _, t in ref]), target_KT)
    assert target_KT.shape[1] == MERGE ** 2 * patches_NP.shape[1]


def test_merged_pixels_are_the_merge_steps_gather():
    """Hand-checked on one 1 x 4 x 4 image: merged token 1 is the top-right 2 x 2 block."""
    patches_NP = torch.arange(16.0)[:, None]  # a patch's one value is its raster index
    pix_QT = merged_pixels(patches_NP, torch.tensor([[1, 4, 4]]), MERGE)
    assert pix_QT.tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    video_NP = torch.arange(8.0)[:, None]  # 2 x 2 x 2: one token per frame, frame 1 after frame 0
    assert merged_pixels(video_NP, torch.tensor([[2, 2, 2]]), MERGE).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_the_last_token_of_every_medium_has_no_target():
    modality_BS, media_ids_BS, _, grid_M3 = _random_batch(torch.Generator().manual_seed(0))
    tokens_M = (grid_M3.prod(-1) // MERGE ** 2).tolist()
    src_K = next_pairs(grid_M3, MERGE)
    assert len(src_K) == sum(tokens_M) - len(tokens_M)  # one target fewer than tokens, per medium
    last_Q = torch.tensor(tokens_M).cumsum(0) - 1
    assert not torch.isin(last_Q, src_K).any()
    b_K, s_K = predicting_positions(modality_BS, grid_M3, MERGE)
    medium_K = media_ids_BS[b_K, s_K]
    for m, n in enumerate(tokens_M):  # the predicting positions are all of m's but its last
        b, s = torch.nonzero(media_ids_BS == m, as_tuple=True)
        assert int((medium_K == m).sum()) == n - 1
        assert (medium_K[(b_K == b[-1]) & (s_K == s[-1])] != m).all()
    one = torch.tensor([[1, 2, 2]])  # a one-token medium: nothing to predict
    assert next_pairs(one, MERGE).numel() == 0
    assert next_targets(torch.randn(4, 3), one, MERGE).shape == (0, 12)


def test_perturbing_one_medium_leaves_the_other_media_targets():
    _, _, patches_NP, grid_M3 = _random_batch(torch.Generator().manual_seed(1))
    tokens_M = grid_M3.prod(-1) // MERGE ** 2
    medium_K = torch.repeat_interleave(torch.arange(len(tokens_M)), tokens_M)[next_pairs(grid_M3, MERGE)]
    start_M = torch.cat([torch.zeros(1, dtype=torch.long), grid_M3.prod(-1).cumsum(0)])
    a = 2
    moved_NP = patches_NP.clone()
    moved_NP[start_M[a]:start_M[a + 1]] += torch.randn_like(moved_NP[start_M[a]:start_M[a + 1]])
    before, after = (next_targets(x, grid_M3, MERGE) for x in (patches_NP, moved_NP))
    assert torch.equal(before[medium_K != a], after[medium_K != a])
    assert (before[medium_K == a] != after[medium_K == a]).any(-1).all()  # every target of a moved


def test_targets_are_normalised_per_token_so_brightness_does_not_count():
    _, _, patches_NP, grid_M3 = _random_batch(torch.Generator().manual_seed(2))
    t_KT = next_targets(patches_NP * 3.0 + 0.5, grid_M3, MERGE)
    torch.testing.assert_close(t_KT.mean(-1), torch.zeros(len(t_KT)), atol=1e-5, rtol=0)
    torch.testing.assert_close(t_KT.var(-1, unbiased=False), torch.ones(len(t_KT)), atol=1e-4, rtol=0)
    torch.testing.assert_close(t_KT, next_targets(patches_NP, grid_M3, MERGE), atol=1e-5, rtol=1e-5)


def _cfg(visual_head: bool = False) -> ModelConfig:
    return ModelConfig(
        VisionConfig(dim=32, depth=1, n_heads=2, patch_size=4),
        DecoderConfig(vocab_size=V, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                      mrope_sections=(2, 3, 3), layer_layout="FS",
                      attention=AttentionConfig(block_size=8, window=16, top_k=1)),
        visual_head=visual_head)


P = _cfg().vision.patch_dim


def _inputs(seed: int = 1):
    torch.manual_seed(seed)
    rows = [[random_doc(V, P, 9, ((IMAGE, (1, 4, 6)),)), random_doc(V, P, 7)],
            [random_doc(V, P, 5, ((VIDEO, (2, 4, 4)), (IMAGE, (1, 2, 2)))), random_doc(V, P, 4)]]
    return pack(rows, 64, P)


def _models():
    torch.manual_seed(0)
    m_off = MultimodalModel(_cfg()).train()
    torch.manual_seed(0)
    return m_off, MultimodalModel(_cfg(visual_head=True)).train()


def test_without_the_head_the_model_is_unchanged():
    m_off, m_on = _models()
    s_off, s_on = m_off.state_dict(), m_on.state_dict()
    assert m_off.visual_head is None and not any("visual_head" in k for k in s_off)
    assert set(s_on) - set(s_off) == {"visual_head.weight", "visual_head.bias"}
    assert all(torch.equal(v, s_on[k]) for k, v in s_off.items())  # the head draws its init last
    inputs = _inputs()
    out_off, out_on = m_off(**inputs), m_on(**inputs)
    assert out_off.visual_next_KT is None and out_on.visual_next_KT is None  # not asked
    assert torch.equal(out_off.logits_BSV, out_on.logits_BSV)
    with pytest.raises(ValueError, match="visual_head"):
        m_off(**inputs, visual_next=True)


def test_predictions_line_up_with_targets_and_the_head_learns():
    _, model = _models()
    inputs = _inputs()
    merge = model.cfg.vision.merge
    target_KT = next_targets(inputs["patches_NP"], inputs["grid_thw_M3"], merge)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        pred_KT = model(**inputs, visual_next=True).visual_next_KT
        assert pred_KT.shape == target_KT.shape == (len(next_pairs(inputs["grid_thw_M3"], merge)),
                                                    merge ** 2 * P)
        loss = (pred_KT - target_KT).square().mean()
        opt.zero_grad()
        loss.backward()
        assert model.visual_head.weight.grad.abs().sum() > 0
        assert model.vision.patch_embed.weight.grad.abs().sum() > 0  # through the decoder to the ViT
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.9 * losses[0], losses


def test_no_media_gives_no_predictions_still_tied_to_the_head():
    _, model = _models()
    torch.manual_seed(2)
    inputs = pack([[random_doc(V, P, 12)]], 16, P)
    pred_KT = model(**inputs, visual_next=True).visual_next_KT
    assert pred_KT.shape == (0, 4 * P)
    pred_KT.sum().backward()
    assert model.visual_head.weight.grad is not None and not model.visual_head.weight.grad.any()


def test_init_weights_resets_the_head_like_the_other_linears():
    _, model = _models()
    with torch.no_grad():
        model.visual_head.weight.fill_(1.0)
        model.visual_head.bias.fill_(1.0)
    model.init_weights()
    std = float(model.visual_head.weight.detach().std())
    assert not model.visual_head.bias.any() and abs(std - model.cfg.decoder.init_std) < 0.002
