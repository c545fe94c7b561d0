import numpy as np
from dp_shards import small_media

from mmtrain.data_pipelines.batch import IMAGE, VIDEO
from mmtrain.data_pipelines.preprocess import Decoded, patchify, plan_size, to_medium


def test_plan_size_is_a_patch_grid_within_the_pixel_range():
    m = small_media(patch_size=4, merge=2, min_pixels=16 * 16, max_pixels=48 * 48)
    rng = np.random.default_rng()
    for h, w in rng.integers(1, 400, size=(300, 2)):
        H, W = plan_size(int(h), int(w), m)
        assert H % 8 == 0 and W % 8 == 0 and H >= 8 and W >= 8
        assert m.max_pixels >= H * W
        if 1 / 4 < h / w < 4:  # extreme aspect ratios may need to leave the range on one side
            assert m.min_pixels <= H * W
            assert abs(np.log((H / W) / (h / w))) < 0.7
    assert plan_size(32, 48, m) == (32, 48)  # already on the grid and in range: unchanged
    assert plan_size(2000, 1000, m) == (64, 32)  # shrunk to fit max_pixels, aspect kept
    assert plan_size(32, 48, m, max_pixels=16 * 24) == (16, 24)  # a smaller budget


def test_patchify_is_raster_order_with_channel_time_row_col_inside():
    m = small_media(patch_size=2, temporal_patch=2, mean=(0.0, 0.0, 0.0), std=(1 / 255,) * 3)
    T, H, W = 4, 6, 4
    t, y, x, c = np.meshgrid(np.arange(T), np.arange(H), np.arange(W), np.arange(3), indexing="ij")
    frames = (t * 60 + y * 8 + x * 2 + c).astype(np.uint8)  # every pixel names itself
    patches_NP = patchify(frames, m)  # normalisation is the identity here
    gt, gh, gw = 2, 3, 2
    assert patches_NP.shape == (gt * gh * gw, 3 * 2 * 2 * 2)
    n = (1 * gh + 2) * gw + 1  # tubelet (t=1, h=2, w=1)
    expect = frames[2:4, 4:6, 2:4].transpose(3, 0, 1, 2).reshape(-1)  # (C, tp, p, p)
    np.testing.assert_array_equal(patches_NP[n], expect.astype(np.float32))


def test_normalisation_uses_mean_and_std():
    m = small_media(patch_size=2, mean=(0.5, 0.5, 0.5), std=(0.25, 0.5, 1.0))
    frames = np.full((2, 2, 2, 3), 255, np.uint8)
    patches = patchify(frames, m).reshape(3, -1)
    np.testing.assert_allclose(patches[:, 0], [2.0, 1.0, 0.5], rtol=1e-6)


def test_image_is_one_frame_repeated_and_video_grid_counts_tubelets():
    m = small_media(patch_size=4, merge=2, min_pixels=8 * 8, max_pixels=16 * 32, video_max_frames=4)
    img = np.random.default_rng().integers(0, 256, (1, 17, 33, 3), dtype=np.uint8)
    med = to_medium(Decoded(IMAGE, img), m, m.max_pixels, 4)
    assert med.kind == IMAGE and med.grid_thw == (1, 4, 8)
    p = med.patches_NP.reshape(32, 3, 2, 16)
    np.testing.assert_array_equal(p[:, :, 0], p[:, :, 1])  # the two temporal slices are the same frame
    vid = np.random.default_rng().integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    med = to_medium(Decoded(VIDEO, vid), m, m.max_pixels, 4)
    assert med.grid_thw == (2, 4, 4) and med.patches_NP.shape == (2 * 4 * 4, 3 * 2 * 4 * 4)
