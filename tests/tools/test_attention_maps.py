"""tools.attention_maps without a checkpoint: capture-and-recompute against the dense eager backend
on a tiny random model, the per-row reductions, word grouping, and the pointing game on synthetic maps.

Legend: H heads, S tokens, R query rows, V visual tokens, D head dim.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import mmtrain.models.self_attention as self_attention
from mmtrain.attention_maps.inputs import ObjectBoxes, build_doc_inputs
from mmtrain.attention_maps.maps import DocAttention, LayerRows, analyze_document, batch_attention_stats
from mmtrain.attention_maps.metrics import (
    AttentionTotals,
    chance_levels,
    match_object,
    object_mask,
    pointing_hit,
    pointing_trials,
    summarize_trials,
)
from mmtrain.data_pipelines.batch import IMAGE, TEXT, VIDEO
from mmtrain.data_pipelines.config import DataConfig, MediaConfig
from mmtrain.data_pipelines.preprocess import Decoded
from mmtrain.data_pipelines.tokenizer import ByteTokenizer
from mmtrain.models.attention import AttentionConfig, build_meta, recompute_probs
from mmtrain.models.attention.dense import dense_mask, dense_probs
from mmtrain.models.decoder import DecoderConfig
from mmtrain.models.multimodal import ModelConfig, MultimodalModel
from mmtrain.models.vision import VisionConfig

TOK = ByteTokenizer()
DATA = DataConfig(seq_len=256, media=MediaConfig(patch_size=8, min_pixels=256, max_pixels=48 * 64))


def _model(backend: str = "dense") -> MultimodalModel:
    # Small blocks, a one-block window, top-1 and no visual_always: the sparse layer cuts blocks.
    attn = AttentionConfig(backend=backend, dense_impl="eager", block_size=4, window=4, top_k=1,
                           visual_always=False)
    dec = DecoderConfig(vocab_size=TOK.vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                        mrope_sections=(2, 3, 3), layer_layout="FS", attention=attn)
    return MultimodalModel(ModelConfig(VisionConfig(dim=32, depth=1, n_heads=2, patch_size=8), dec)).eval()


def _frames(T: int, h: int = 48, w: int = 64) -> np.ndarray:
    return np.random.randint(0, 255, (T, h, w, 3), dtype=np.uint8)


def _doc(kind: str, text: str = "a red circle and a blue star.", objects=None):
    medium = Decoded(IMAGE, _frames(1)) if kind == "image" else Decoded(VIDEO, _frames(4))
    return build_doc_inputs(kind, kind, [medium, text], TOK, DATA, None, [objects or []])


class _Recorder:
    """Wraps models.self_attention.attend: records q, k, v, the output and the capture of each call."""

    def __init__(self, attend):
        self.attend, self.calls = attend, []

    def __call__(self, q, k, v, meta, cfg, sparse=False, capture=None, stats=None, context=None):
        cap = {} if capture is None else capture
        out = self.attend(q, k, v, meta, cfg, sparse=sparse, capture=cap, stats=stats, context=context)
        self.calls.append(dict(q=q, k=k, v=v, out=out, sparse=sparse, capture=cap, cfg=cfg))
        return out


@pytest.mark.parametrize("kind", ["image", "video"])
def test_recomputed_rows_are_the_dense_eager_attention(monkeypatch, kind):
    model, doc = _model(), _doc(kind, "a red circle and a blue star. " * random.randint(1, 3))
    rec = _Recorder(self_attention.attend)
    monkeypatch.setattr(self_attention, "attend", rec)
    att = analyze_document(model, doc, [0, 1])
    decoder_calls = rec.calls[-2:]  # the vision encoder's come first
    inputs = doc.batch.model_inputs()
    meta = build_meta(inputs["doc_ids_BS"], inputs["span_ids_BS"], 4)
    S, vis_S = len(doc), torch.from_numpy(doc.document.modality_L != TEXT)
    rows_R = torch.from_numpy(att.rows)
    for layer, call in enumerate(decoder_calls):
        q, k, v, sparse = call["q"], call["k"], call["v"], call["sparse"]
        H, K = q.shape[1], k.shape[1]
        assert sparse == (layer == 1) and ("selection" in call["capture"]) == sparse
        p_HSS = recompute_probs(call["capture"], meta, call["cfg"], sparse, torch.arange(S), chunk=7)
        # The rows are the layer's own attention: P @ V is what the dense eager backend returned.
        out_HSD = p_HSS @ v[0].repeat_interleave(H // K, 0)
        torch.testing.assert_close(out_HSD, call["out"][0], atol=2e-5, rtol=1e-4)
        mask_1HSS = dense_mask(meta, call["cfg"], call["capture"].get("selection"), H)
        ref_HSS = dense_probs(q, k, mask_1HSS.expand(1, H, S, S))[0]
        torch.testing.assert_close(p_HSS, ref_HSS, atol=1e-6, rtol=0)
        # The tool's reductions of those rows.
        r: LayerRows = att.per_layer[layer]
        p_HRS = p_HSS[:, rows_R]
        torch.testing.assert_close(r.mass_HR, p_HRS[..., vis_S].sum(-1), atol=1e-6, rtol=0)
        torch.testing.assert_close(r.visual_HKV, p_HRS[..., vis_S], atol=1e-6, rtol=0)
        torch.testing.assert_close(r.sink_HR, p_HRS[..., 0], atol=1e-6, rtol=0)
        torch.testing.assert_close(r.entropy_HR, torch.special.entr(p_HRS).sum(-1), atol=1e-5, rtol=0)
        if sparse:  # the selection cut allowed pairs for these rows, and they get no probability
            cut_HRS = (dense_mask(meta, None, None, H) & ~mask_1HSS)[0].expand(H, S, S)[:, rows_R]
            assert cut_HRS.any(), "test setup: the sparse layer must cut something"
            assert (p_HRS[cut_HRS] == 0).all()
            unmasked_HRS = recompute_probs(call["capture"], meta, call["cfg"], False, rows_R)
            assert (unmasked_HRS[cut_HRS] > 0).all()


def test_capture_is_backend_independent():
    """The tool's numbers do not depend on which backend ran the forward (gather on CPU)."""
    doc = _doc("image")
    dense, gather = _model("dense"), _model("gather")
    gather.load_state_dict(dense.state_dict())
    a, b = analyze_document(dense, doc, [0, 1]), analyze_document(gather, doc, [0, 1])
    for layer in (0, 1):
        torch.testing.assert_close(a.per_layer[layer].visual_HKV, b.per_layer[layer].visual_HKV,
                                   atol=1e-5, rtol=0)


def test_batch_stats_match_document_stats():
    model, doc = _model(), _doc("video")
    att = analyze_document(model, doc, [0, 1], chunk=5)
    totals = AttentionTotals([0, 1], 4)
    totals.add(att)
    inputs = doc.batch.model_inputs()
    text_BS = torch.from_numpy(~doc.special_L)[None]
    stats = batch_attention_stats(model, inputs, text_BS, [0, 1], chunk=3)
    means = totals.means()
    for i in (0, 1):
        assert int(stats[i]["rows"]) == totals.rows == int(att.stat_rows.sum())
        for key in ("mass", "entropy", "sink"):
            np.testing.assert_allclose(stats[i][key].numpy(), means[key][i], atol=1e-5)


def test_words_and_segments():
    doc = _doc("image", "a Red  circle, and a star.")
    assert [w.text for w in doc.words] == ["a", "red", "circle", "", "and", "a", "star", ""]
    (seg,) = doc.segments
    assert seg.medium == 0 and not seg.truncated
    red = doc.words[1]
    assert "".join(doc.token_strs[p] for p in range(red.start, red.end)) == "Red"
    m = doc.media[0]
    assert m.grid_thw == (1, 3, 4) and m.resized_hw == (48, 64) and m.orig_hw == (48, 64)
    assert doc.document.modality_L[m.start] == IMAGE and doc.document.modality_L[m.start - 1] == TEXT


# ----- pointing game ------------------------------------------------------------------------------
def _fake_attention(doc, peak_cells: dict[int, list[tuple[int, int]]]) -> DocAttention:
    """A DocAttention whose rows put all their visual probability on one token per slice:
    peak_cells[pos] = [(row, col) per slice]; other rows are uniform."""
    m = doc.media[0]
    t, h, w = m.grid_thw
    rows = np.array([p for p in range(m.start + m.n_tokens, len(doc))])
    vis_HRV = torch.full((2, len(rows), t * h * w), 1.0 / (t * h * w))
    for i, p in enumerate(rows):
        if p in peak_cells:
            vis_HRV[:, i] = 0.0
            for s, (r, c) in enumerate(peak_cells[p]):
                vis_HRV[:, i, s * h * w + r * w + c] = 1.0 / t
    zeros = torch.zeros(2, len(rows))
    lr = LayerRows(0, False, zeros, zeros, zeros, vis_HRV, None, torch.ones(1, 1, dtype=torch.bool))
    return DocAttention(doc, [0], rows, ~doc.special_L[rows], rows, {0: lr}, 2, 4)


def test_pointing_game_hits_inside_and_misses_outside():
    # Image 48 x 64 px -> 3 x 4 tokens of 16 px. The red object sits in token (1, 2).
    red = ObjectBoxes({"color": "red", "shape": "circle"}, [(34.0, 18.0, 44.0, 28.0)])
    blue = ObjectBoxes({"color": "blue", "shape": "star"}, [(2.0, 2.0, 12.0, 12.0)])
    doc = _doc("image", "a red circle and a blue star.", [red, blue])
    words = {w.text: w for w in doc.words}
    inside = _fake_attention(doc, {words["red"].start: [(1, 2)], words["circle"].start: [(1, 2)],
                                   words["blue"].start: [(0, 0)], words["star"].start: [(0, 0)]})
    outside = _fake_attention(doc, {words[x].start: [(2, 0)] for x in ("red", "circle", "blue", "star")})
    for att, want in ((inside, 1.0), (outside, 0.0)):
        trials = pointing_trials(att)
        assert sorted(t.word for t in trials) == ["blue", "circle", "red", "star"]
        s = summarize_trials(trials, [0])
        assert s["all"]["accuracy"]["0"] == want and s["all"]["accuracy_mean_layers"] == want
        assert s["colour"]["n"] == 2 and s["shape"]["n"] == 2
        assert s["colour"]["chance"] == pytest.approx((100 / (48 * 64) + 100 / (48 * 64)) / 2)
    # The other-object control: pointing at the red circle while reading "blue" hits the other object.
    swapped = _fake_attention(doc, {words["blue"].start: [(1, 2)]})
    (t,) = [t for t in pointing_trials(swapped) if t.word == "blue"]
    assert t.accuracy("0") == 0.0 and t.accuracy_other("0") == 1.0


def test_pointing_game_video_follows_the_box_per_slice():
    # 4 frames, temporal patch 2 -> 2 slices of 3 x 4 tokens; the object moves right by two tokens.
    boxes = [(2.0, 18.0, 12.0, 28.0)] * 2 + [(34.0, 18.0, 44.0, 28.0)] * 2
    obj = ObjectBoxes({"color": "green", "shape": "cross"}, boxes)
    doc = _doc("video", "a green cross moves right.", [obj])
    green = next(w for w in doc.words if w.text == "green")
    follow = _fake_attention(doc, {green.start: [(1, 0), (1, 2)]})
    stay = _fake_attention(doc, {green.start: [(1, 0), (1, 0)]})
    assert next(t for t in pointing_trials(follow) if t.word == "green").accuracy("0") == 1.0
    assert next(t for t in pointing_trials(stay) if t.word == "green").accuracy("0") == 0.5


def test_pointing_primitives():
    m = _doc("image").media[0]
    box = ObjectBoxes({"shape": "square"}, [(20.0, 20.0, 40.0, 30.0)])  # tokens (1, 1) and (1, 2)
    mask = object_mask(box, m, 0)
    from mmtrain.attention_maps.metrics import cell_rects

    rects = cell_rects(m)
    assert rects.shape == (3, 4, 4) and tuple(rects[2, 3]) == (48.0, 32.0, 64.0, 48.0)
    peak = np.zeros((3, 4))
    peak[1, 1] = 1.0
    assert pointing_hit(peak, rects, mask) == (True, (1, 1))
    peak = np.zeros((3, 4))
    peak[2, 3] = 1.0
    assert pointing_hit(peak, rects, mask) == (False, (2, 3))
    share, cells = chance_levels(rects, mask)
    assert share == pytest.approx(200 / (48 * 64)) and cells == pytest.approx(2 / 12)
    objs = [ObjectBoxes({"color": "red", "shape": "circle"}, [(0, 0, 1, 1)]),
            ObjectBoxes({"color": "red", "shape": "star"}, [(0, 0, 1, 1)])]
    assert match_object("red", objs) is None  # ambiguous: skipped
    assert match_object("star", objs) == (1, "shape") and match_object("cat", objs) is None


def test_bounded_maps_give_the_same_pointing_game():
    from mmtrain.attention_maps.metrics import pointing_rows

    red = ObjectBoxes({"color": "red", "shape": "circle"}, [(34.0, 18.0, 44.0, 28.0)])
    doc = _doc("image", "a red circle.", [red])
    model = _model()
    full = analyze_document(model, doc, [0, 1])
    bounded = analyze_document(model, doc, [0, 1], map_rows=pointing_rows(doc))
    assert len(bounded.map_rows) < len(full.map_rows)
    for q in ("token", "predictor"):
        a, b = pointing_trials(full, q), pointing_trials(bounded, q)
        assert [t.to_dict() for t in a] == [t.to_dict() for t in b] and len(a) == 2
    torch.testing.assert_close(full.per_layer[1].mass_HR, bounded.per_layer[1].mass_HR)


def test_heat_panel_keeps_unattended_pixels_visible_and_labels_the_target():
    from mmtrain.attention_maps import plots

    m = _doc("image").media[0]
    frame = np.full((*m.orig_hw, 3), 200, np.uint8)  # a light grey image
    t, h, w = m.grid_thw
    map_hw = np.zeros((h, w))
    map_hw[0, 0] = 1.0
    box = (0.0, 0.0, m.orig_hw[1] / w, m.orig_hw[0] / h)  # the hot cell
    pw, ph = plots.display_size(m)
    bare = np.asarray(plots.heat_panel(frame, None, m, "t", [(box, "target: red circle")]))
    pic = np.asarray(plots.heat_panel(frame, map_hw, m, "t", [(box, "target: red circle")]))
    assert pic.shape == (ph + plots.TITLE, pw, 3) and max(pw, ph) == plots.PANEL
    far = pic[-2, -2].astype(int)  # a cold cell: the image shows through, not the colour map's black
    assert np.abs(far - 200).max() < 0.2 * 200
    assert not np.array_equal(pic, bare)
    tag = bare[plots.TITLE:, :, :]
    assert ((tag == plots.BOX).all(-1)).sum() > 50  # the box and its filled label tag
