"""Vision encoder: media never see each other, merge order, video vs image, no media.

Legend: N patches, P patch dim, Q merged tokens, O output dim.
"""

from __future__ import annotations

import pytest
import torch

from mmtrain.models.attention import AttentionConfig
from mmtrain.models.attention.testing import backends_on
from mmtrain.models.vision import VisionConfig, VisionEncoder, patch_layout

CFG = VisionConfig(dim=32, depth=2, n_heads=2, patch_size=4, merge=2)
P = CFG.patch_dim


def _encoder(backend: str = "dense") -> VisionEncoder:
    return VisionEncoder(CFG, 48, AttentionConfig(backend=backend, block_size=8)).eval()


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x - y).norm() / y.norm()).item()


@pytest.mark.parametrize("backend", backends_on("cpu", backward=True, layer="full"))
def test_packed_media_do_not_see_each_other(backend: str) -> None:
    enc = _encoder(backend)
    img_NP = torch.randn(4 * 6, P)
    alone_QO = enc(img_NP, torch.tensor([[1, 4, 6]]))
    others = [(torch.randn(2 * 4 * 2, P), [2, 4, 2]), (torch.randn(6 * 2, P), [1, 6, 2])]
    packed_NP = torch.cat([others[0][0], img_NP, others[1][0]])
    grid_M3 = torch.tensor([others[0][1], [1, 4, 6], others[1][1]])
    packed_QO = enc(packed_NP, grid_M3)
    assert packed_QO.shape == (packed_NP.shape[0] // 4, 48)  # N / merge^2, decoder width
    torch.testing.assert_close(packed_QO[4:10], alone_QO, atol=1e-5, rtol=1e-5)


def test_merge_groups_2x2_neighbourhoods_in_raster_order() -> None:
    grid_M3 = torch.tensor([[1, 2, 2], [2, 4, 4]])
    medium_N, pos_3N, src_N = patch_layout(grid_M3, 4 + 32, merge=2)
    assert src_N[:4].tolist() == [0, 1, 2, 3]
    # second medium starts at 4: first merged token = rows {0,1} x cols {0,1} of its frame 0
    assert src_N[4:8].tolist() == [4 + 0, 4 + 1, 4 + 4, 4 + 5]
    assert src_N[8:12].tolist() == [4 + 2, 4 + 3, 4 + 6, 4 + 7]  # next along w
    assert src_N[20:24].tolist() == [4 + 16, 4 + 17, 4 + 20, 4 + 21]  # frame 1 after frame 0
    assert sorted(src_N.tolist()) == list(range(36))
    assert medium_N.tolist() == [0] * 4 + [1] * 32
    assert pos_3N[:, 4 + 21].tolist() == [1, 1, 1]  # (t, h, w) of patch 21 of a 2x4x4 grid


def test_video_of_a_static_frame_is_sane() -> None:
    enc = _encoder()
    frame_NP = torch.randn(16, P)
    image_QO = enc(frame_NP, torch.tensor([[1, 4, 4]]))
    video_QO = enc(torch.cat([frame_NP, frame_NP]), torch.tensor([[2, 4, 4]]))
    other_QO = enc(torch.randn(16, P), torch.tensor([[1, 4, 4]]))
    assert video_QO.shape == (8, 48)
    assert _rel(video_QO[:4], image_QO) < 0.2 * _rel(other_QO, image_QO)  # same content, same tokens
    assert _rel(video_QO[4:], image_QO) < 0.2 * _rel(other_QO, image_QO)
    assert not torch.allclose(video_QO[:4], video_QO[4:])  # frames are ordered, not a bag


def test_no_media_returns_zero_rows_and_zero_gradients() -> None:
    enc = _encoder().train()
    out_QO = enc(torch.zeros(0, P), torch.zeros(0, 3, dtype=torch.long))
    assert out_QO.shape == (0, 48)
    (out_QO.sum() + 0.0).backward()
    for name, p in enc.named_parameters():
        assert p.grad is not None and not p.grad.any(), name


def test_bad_inputs_are_named() -> None:
    enc = _encoder()
    with pytest.raises(ValueError, match="grid_thw:"):
        enc(torch.randn(10, P), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="grid_thw:"):
        enc(torch.randn(12, P), torch.tensor([[1, 3, 4]]))
    with pytest.raises(ValueError, match="patches:"):
        enc(torch.randn(16, P + 1), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="n_heads:"):
        VisionConfig(dim=36, n_heads=4)


def test_abs_pos_embedding_is_resolution_free_and_packing_safe():
    """Absolute positions are relative coordinates: an image alone equals it packed with others."""
    torch.manual_seed(int(torch.randint(0, 2**31, ()).item()))
    cfg = VisionConfig(dim=32, depth=1, n_heads=2, abs_pos_grid=4)
    enc = VisionEncoder(cfg, out_dim=16).eval()
    a = torch.randn(1 * 4 * 6, cfg.patch_dim)
    b = torch.randn(1 * 8 * 2, cfg.patch_dim)
    alone = enc(a, torch.tensor([[1, 4, 6]]))
    packed = enc(torch.cat([b, a]), torch.tensor([[1, 8, 2], [1, 4, 6]]))
    torch.testing.assert_close(packed[-alone.shape[0]:], alone, rtol=1e-5, atol=1e-5)
    # A flat frame: without absolute positions every merged token is the same (RoPE only sees
    # relative offsets); with them, the corners differ.
    flat = torch.randn(1, cfg.patch_dim).expand(4 * 4, -1)
    grid = torch.tensor([[1, 4, 4]])
    no_pos = VisionEncoder(VisionConfig(dim=32, depth=1, n_heads=2), out_dim=16).eval()
    out_plain, out_pos = no_pos(flat, grid), enc(flat, grid)
    torch.testing.assert_close(out_plain[0], out_plain[-1], rtol=1e-5, atol=1e-5)
    assert (out_pos[0] - out_pos[-1]).abs().max() > 1e-3


def _alternating() -> tuple[torch.Tensor, torch.Tensor]:
    """Images (1x4x4) and clips (2x4x4) in alternation: in input order no two equal sizes touch."""
    grid_M3 = torch.tensor([[1, 4, 4], [2, 4, 4], [1, 4, 4], [2, 4, 4], [1, 4, 4]])
    return torch.randn(int(grid_M3.prod(-1).sum()), P), grid_M3


@pytest.mark.parametrize("backend", backends_on("cpu", backward=True, layer="full"))
def test_media_grouped_by_size_match_dense_and_each_alone(backend: str) -> None:
    """Every backend runs the media sorted by size (their medium ids then out of order); outputs
    and gradients stay in input order and equal dense attention over the media in input order,
    and each medium encoded alone."""
    patches_NP, grid_M3 = _alternating()
    fast, ref = _encoder(backend), _encoder("dense")
    ref.load_state_dict(fast.state_dict())
    ref.group_by_size = False  # the reference: dense attention, media in input order
    x_fast = patches_NP.clone().requires_grad_()
    x_ref = patches_NP.clone().requires_grad_()
    out_fast, out_ref = fast(x_fast, grid_M3), ref(x_ref, grid_M3)
    torch.testing.assert_close(out_fast, out_ref, atol=1e-5, rtol=1e-5)
    g_QO = torch.randn_like(out_ref)
    out_fast.backward(g_QO)
    out_ref.backward(g_QO)
    torch.testing.assert_close(x_fast.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    for p_fast, p_ref in zip(fast.parameters(), ref.parameters()):
        torch.testing.assert_close(p_fast.grad, p_ref.grad, atol=1e-5, rtol=1e-5)
    start_Q = 0  # each medium's tokens equal its encoding alone
    for t, h, w in grid_M3.tolist():
        n = t * h * w
        q = n // CFG.merge ** 2
        n0 = start_Q * CFG.merge ** 2
        alone_QO = fast(patches_NP[n0:n0 + n], torch.tensor([[t, h, w]]))
        torch.testing.assert_close(out_fast[start_Q:start_Q + q], alone_QO, atol=1e-5, rtol=1e-5)
        start_Q += q


def test_equal_sizes_share_one_unmasked_fused_call(monkeypatch) -> None:
    """Grouped by size, each block attends the 3 images in one batched call and the 2 clips in
    another, without a mask (in input order the fused backend would mask a block diagonal)."""
    import torch.nn.functional as F

    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((q.shape[0], attn_mask is None))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    patches_NP, grid_M3 = _alternating()
    with torch.no_grad():
        _encoder("sdpa")(patches_NP, grid_M3)
    assert calls == [(3, True), (2, True)] * CFG.depth


def test_out_norm_bounds_the_visual_tokens_whatever_the_projector_weights() -> None:
    """vision.out_norm: every visual token leaves at RMS = the norm's gain, however large the
    projector's weights grow (they grew 100-1000x in text-heavy runs); off, the state_dict is as before."""
    import dataclasses

    torch.manual_seed(0)
    enc = VisionEncoder(dataclasses.replace(CFG, out_norm=True), 48).eval()
    assert set(_encoder().state_dict()) == set(enc.state_dict()) - {"out_norm.weight"}
    x_NP, grid = torch.randn(4 * 6, P), torch.tensor([[1, 4, 6]])
    with torch.no_grad():
        enc.projector.w_out.weight.mul_(1000.0)
        rms_Q = enc(x_NP, grid).pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms_Q, torch.ones_like(rms_Q), atol=1e-4, rtol=1e-4)
    enc.out_norm.weight.data.fill_(0.5)  # the gain is the scale
    torch.testing.assert_close(enc(x_NP, grid).pow(2).mean(-1).sqrt(), 0.5 * rms_Q, atol=1e-4, rtol=1e-4)


def test_out_center_removes_each_mediums_constant_and_keeps_media_apart() -> None:
    """vision.out_center: a constant added to every visual token (what the projector learned in
    text-heavy runs) leaves no trace; each medium is centred on its own tokens only."""
    import dataclasses

    torch.manual_seed(0)
    enc = VisionEncoder(dataclasses.replace(CFG, out_norm=True, out_center=True), 48).eval()
    a_NP, b_NP = torch.randn(4 * 6, P), torch.randn(4 * 4, P)
    grid = torch.tensor([[1, 4, 6], [1, 4, 4]])
    with torch.no_grad():
        out_QO = enc(torch.cat([a_NP, b_NP]), grid)
        alone_QO = enc(a_NP, grid[:1])
        handle = enc.projector.register_forward_hook(lambda m, i, o: o + 10.0 * torch.randn(48))
        shifted_QO = enc(torch.cat([a_NP, b_NP]), grid)
        handle.remove()
    torch.testing.assert_close(out_QO[:6], alone_QO, atol=1e-5, rtol=1e-5)  # no leak across media
    torch.testing.assert_close(shifted_QO, out_QO, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="out_center: needs out_norm"):
        VisionConfig(out_center=True)
