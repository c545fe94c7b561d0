import io

import numpy as np
import pytest
from dp_shards import image_bytes, small_media, video_bytes
from PIL import Image

from mmtrain.data_pipelines.decode import decode_image, decode_text, decode_video, sample_frame_indices
from mmtrain.data_pipelines.ledger import SkipSample


def _png(im: Image.Image, **save) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG", **save)
    return buf.getvalue()


def _reason(fn, *args) -> str:
    with pytest.raises(SkipSample) as e:
        fn(*args)
    return e.value.reason


MEDIA = small_media()


# ----- images ---------------------------------------------------------------------------------
def test_palette_and_grey_modes_become_rgb():
    rgb = np.random.default_rng().integers(0, 256, (9, 7, 3), dtype=np.uint8)
    p = Image.fromarray(rgb).quantize(16)
    out = decode_image(_png(p), MEDIA)
    assert out.shape == (9, 7, 3) and out.dtype == np.uint8
    np.testing.assert_array_equal(out, np.asarray(p.convert("RGB")))
    grey = Image.fromarray(rgb[..., 0])
    np.testing.assert_array_equal(decode_image(_png(grey), MEDIA), np.repeat(rgb[..., :1], 3, axis=2))


def test_alpha_composites_on_grey():
    rgba = np.zeros((4, 5, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[0, :, 3] = 255  # first row opaque red, the rest fully transparent
    out = decode_image(_png(Image.fromarray(rgba, "RGBA")), MEDIA)
    assert out[0, 0].tolist() == [200, 0, 0] and out[2, 2].tolist() == [128, 128, 128]
    la = Image.fromarray(rgba[..., [0, 3]], "LA")
    out = decode_image(_png(la), MEDIA)
    assert out[0, 0].tolist() == [200] * 3 and out[3, 4].tolist() == [128] * 3
    p = Image.new("P", (3, 3), 1)
    p.putpalette([0, 0, 0, 255, 255, 255] + [0] * 762)
    assert decode_image(_png(p, transparency=1), MEDIA)[1, 1].tolist() == [128] * 3


def test_cmyk_jpeg_and_16_bit_png():
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # red
    buf = io.BytesIO()
    cmyk.save(buf, format="JPEG", quality=95)
    r, g, b = decode_image(buf.getvalue(), MEDIA)[4, 4].tolist()
    assert r > 200 and g < 60 and b < 60
    v16 = np.array([[0, 257 * 100], [65535, 257 * 7]], np.uint16)
    out = decode_image(_png(Image.fromarray(v16)), MEDIA)
    assert out[..., 0].tolist() == [[0, 100], [255, 7]]


def test_exif_orientation_is_applied():
    arr = np.zeros((10, 20, 3), np.uint8)
    arr[0, 0] = 255  # a white corner pixel, top-left as stored
    im = Image.fromarray(arr)
    exif = im.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buf = io.BytesIO()
    im.save(buf, format="PNG", exif=exif)
    out = decode_image(buf.getvalue(), MEDIA)
    assert out.shape == (20, 10, 3) and out[0, -1].tolist() == [255] * 3


def test_bad_images_are_skipped_with_reasons():
    good = image_bytes(30, 30, fmt="JPEG")
    assert _reason(decode_image, good[: len(good) // 2], MEDIA) == "corrupt_image"
    assert _reason(decode_image, b"not an image at all", MEDIA) == "corrupt_image"
    assert _reason(decode_image, good, small_media(max_image_pixels=899)) == "too_large"
    assert decode_image(good, small_media(max_image_pixels=900)).shape == (30, 30, 3)


def test_text_must_be_utf8_and_non_empty():
    assert decode_text("\ufeff héllo \n".encode()) == "héllo"
    assert _reason(decode_text, b"\xff\xfe\xfa") == "bad_text"
    assert _reason(decode_text, b"  \n") == "empty_text"


# ----- video ----------------------------------------------------------------------------------
def test_frame_sampling_rate_clamp_and_temporal_padding():
    m = small_media(video_fps=2.0, video_min_frames=2, video_max_frames=8, temporal_patch=2)
    assert sample_frame_indices(16, 8.0, m) == [2, 6, 10, 14]  # 2 s at 2 fps, uniform in time
    assert sample_frame_indices(80, 8.0, m) == [5 + 10 * i for i in range(8)]  # clamped to 8
    assert sample_frame_indices(3, 8.0, m) == [0, 2]  # clamped up to 2
    m3 = small_media(video_fps=3.0, video_min_frames=3, video_max_frames=8)
    assert sample_frame_indices(8, 8.0, m3) == [1, 4, 6, 6]  # 3 frames, padded with the last


def test_video_decodes_the_sampled_frames():
    m = small_media(video_fps=4.0, video_min_frames=2, video_max_frames=4)
    data = video_bytes(frames=8, h=32, w=32, fps=8, values=[10 + 25 * t for t in range(8)])
    out = decode_video(data, m)  # 1 s at 4 fps -> frames 1, 3, 5, 7
    assert out.shape == (4, 32, 32, 3)
    np.testing.assert_allclose(out[:, 16, 16, 0], [35, 85, 135, 185], atol=4)


def test_video_of_a_size_decord_mis_decodes_falls_back():
    media = small_media(video_max_frames=4, max_pixels=32 * 48)  # no reduction at decode
    out = decode_video(video_bytes(frames=4, h=32, w=48, fps=4), media)
    assert out.shape[1:] == (32, 48, 3) and len(out) % 2 == 0


def test_pyav_as_the_decoder_never_calls_decord_and_gives_its_frames(monkeypatch):
    import mmtrain.data_pipelines.decode as decode

    data = video_bytes(frames=8, h=32, w=32, fps=8, values=[10 + 25 * t for t in range(8)])
    m = small_media(video_fps=4.0, video_min_frames=2, video_max_frames=4)
    by_decord = decode_video(data, m)

    calls = []
    monkeypatch.setattr(decode, "_decode_decord", lambda *a: calls.append(a))  # a failure would fall back
    by_pyav = decode_video(data, small_media(video_fps=4.0, video_min_frames=2, video_max_frames=4,
                                             video_decoder="pyav"))
    assert calls == [] and by_pyav.shape == by_decord.shape
    assert np.abs(by_pyav.astype(int) - by_decord).max() <= 4  # the same H.264 frames; RGB conversions differ
    for bad in (b"garbage" * 50, data[: len(data) // 3]):
        assert _reason(decode_video, bad, small_media(video_decoder="pyav")) == "corrupt_video"


def test_bad_videos_are_skipped():
    good = video_bytes(4)
    for bad in (b"", b"garbage" * 50, good[: len(good) // 3]):
        assert _reason(decode_video, bad, MEDIA) == "corrupt_video"


# ----- memory bounds ----------------------------------------------------------------------------
def test_pyav_fallback_holds_only_the_sampled_frames(monkeypatch):
    import tracemalloc

    import mmtrain.data_pipelines.decode as decode

    def broken(*a):
        raise RuntimeError("decord cannot read this")

    monkeypatch.setattr(decode, "_decode_decord", broken)
    data = video_bytes(frames=600, h=48, w=64, fps=30, values=[t % 250 for t in range(600)])
    media = small_media(max_pixels=48 * 64, video_max_frames=4)
    tracemalloc.start()
    out = decode_video(data, media)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert out.shape == (4, 48, 64, 3)
    assert peak < 600 * 48 * 64 * 3 / 20  # all frames in RGB would be 5.5 MB


def test_video_caps_come_from_the_headers_before_decoding(monkeypatch):
    import mmtrain.data_pipelines.decode as decode

    def never(*a):
        raise AssertionError("decoded")

    data = video_bytes(frames=4, h=64, w=64)
    with monkeypatch.context() as m:
        m.setattr(decode, "_decode_decord", never)
        m.setattr(decode, "_decode_pyav", never)
        assert _reason(decode_video, data, small_media(max_image_pixels=64 * 63)) == "too_large"
        assert _reason(decode_video, data, small_media(max_source_frames=3)) == "too_large"
    out = decode_video(data, small_media(max_pixels=8 * 8, min_pixels=8 * 8))  # target 8 x 8
    assert out.shape[1:] == (16, 16, 3)  # decoded at twice the target per side, not 64 x 64
    big = decode_image(image_bytes(64, 64), small_media(max_pixels=8 * 8, min_pixels=8 * 8))
    assert big.shape == (16, 16, 3)


def test_clip_cache_decodes_each_clip_once_and_returns_the_same_frames(monkeypatch):
    import mmtrain.data_pipelines.decode as decode

    calls = []
    orig = decode._decode_video
    monkeypatch.setattr(decode, "_decode_video", lambda d, m: calls.append(1) or orig(d, m))
    monkeypatch.setattr(decode, "_CLIP_CACHE", None)
    a = video_bytes(frames=8, values=[10 + 25 * t for t in range(8)])
    b = video_bytes(frames=8, values=[200 - 20 * t for t in range(8)])
    off = small_media(video_fps=4.0, video_min_frames=2, video_max_frames=4)
    on = small_media(video_fps=4.0, video_min_frames=2, video_max_frames=4, video_cache_mb=1)
    want_a, want_b = decode_video(a, off), decode_video(b, off)
    assert len(calls) == 2 and decode._CLIP_CACHE is None  # off: nothing kept
    got = [decode_video(x, on) for x in (a, b, a, b, a)]
    assert len(calls) == 4  # a and b decoded once each
    for g, w in zip(got, [want_a, want_b] * 3):
        np.testing.assert_array_equal(g, w)
    assert not got[2].flags.writeable  # a shared clip cannot be written into
    other = small_media(video_fps=2.0, video_min_frames=2, video_max_frames=4, video_cache_mb=1)
    assert decode_video(a, other).shape[0] == 2 and len(calls) == 5  # other settings: decoded again
    with pytest.raises(SkipSample):  # a bad clip is judged every time, never cached
        decode_video(b"\0" * 64, on)


def test_clip_cache_drops_the_least_recently_used_past_its_budget():
    from mmtrain.data_pipelines.decode import ClipCache

    cache = ClipCache(budget=250)
    clips = {k: np.zeros(100, np.uint8) for k in "abc"}
    cache.put(("a",), clips["a"])
    cache.put(("b",), clips["b"])
    assert cache.get(("a",)) is clips["a"]  # a is now the most recent
    cache.put(("c",), clips["c"])  # 300 > 250: b goes
    assert cache.get(("b",)) is None and cache.get(("a",)) is not None and cache.size == 200
    cache.put(("big",), np.zeros(300, np.uint8))  # larger than the budget: returned, not kept
    assert cache.get(("big",)) is None and cache.size == 200
