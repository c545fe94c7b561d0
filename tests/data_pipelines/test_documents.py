import json

import numpy as np
import pytest
from dp_shards import data_cfg, image_bytes, small_media, video_bytes

from mmtrain.data_pipelines.batch import (
    IGNORE_INDEX,
    IMAGE,
    TASK_IMAGE_TEXT,
    TASK_TEXT,
    TASK_VIDEO_TEXT,
    TEXT,
    VIDEO,
)
from mmtrain.data_pipelines.documents import make_documents
from mmtrain.data_pipelines.ledger import SkipSample
from mmtrain.data_pipelines.shards import RawSample
from mmtrain.data_pipelines.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
S = TOK.special


def _raw(key="k", **members) -> RawSample:
    enc = {k.replace("_", "."): (v.encode() if isinstance(v, str) else json.dumps(v).encode()
                                  if isinstance(v, dict) else v) for k, v in members.items()}
    return RawSample(key, enc, 0)


def _docs(raw, **cfg):
    return make_documents(raw, TOK, data_cfg(**cfg))


def _skip(raw, **cfg) -> str:
    with pytest.raises(SkipSample) as e:
        _docs(raw, **cfg)
    return e.value.reason


def test_image_text_layout_positions_labels():
    # 20x40 -> 16x32 px with patch 4: grid (1, 4, 8), merged 1 x 2 x 4 = 8 placeholders
    media = small_media(max_pixels=16 * 32)
    kind, (doc,) = _docs(_raw(png=image_bytes(20, 40), txt="a cat"), media=media)
    assert kind == "image" and doc.task == TASK_IMAGE_TEXT and doc.media[0].grid_thw == (1, 4, 8)
    toks = doc.tokens_L.tolist()
    assert toks == [S.bos, S.image_start] + [S.image_pad] * 8 + [S.image_end] + list(b"a cat") + [S.eos]
    assert doc.modality_L.tolist() == [TEXT, TEXT] + [IMAGE] * 8 + [TEXT] * 7
    assert doc.span_L.tolist() == [-1, -1] + [0] * 8 + [-1] * 7
    t, h, w = doc.pos_3L
    assert t[:2].tolist() == [0, 1] and t[2:10].tolist() == [2] * 8  # one frame
    assert h[2:10].tolist() == [2, 2, 2, 2, 3, 3, 3, 3] and w[2:10].tolist() == [2, 3, 4, 5] * 2
    assert (t[10:] == h[10:]).all() and t[10:].tolist() == list(range(6, 13))  # 2 + max(1, 2, 4)
    labels = doc.labels_L.tolist()
    assert labels[:10] == [IGNORE_INDEX] * 10  # next token is a marker or a placeholder
    assert labels[10:-1] == toks[11:] and labels[-1] == IGNORE_INDEX  # caption and eos are targets


def test_video_spans_one_per_temporal_slice():
    media = small_media(video_fps=8.0, video_max_frames=4, max_pixels=8 * 8, min_pixels=8 * 8)
    kind, (doc,) = _docs(_raw(mp4=video_bytes(4, 32, 32, fps=8), txt="moves"), media=media)
    assert kind == "video" and doc.task == TASK_VIDEO_TEXT and doc.media[0].grid_thw == (2, 2, 2)
    vis = doc.modality_L == VIDEO
    assert vis.sum() == 2 and doc.span_L[vis].tolist() == [0, 1]
    assert doc.pos_3L[0, vis].tolist() == [2, 3]  # t advances per slice
    assert doc.tokens_L[1] == S.video_start and doc.tokens_L[4] == S.video_end


def test_interleaved_keeps_segment_order_and_obelics_form():
    seg = {"segments": [{"text": "one"}, {"image": "0.png"}, {"text": "two"}, {"image": "k.1.jpg"}]}
    raw = _raw(json=seg, **{"0_png": image_bytes(8, 8), "1_jpg": image_bytes(8, 8, fmt="JPEG")})
    kind, (doc,) = _docs(raw)
    assert kind == "interleaved" and doc.task == TASK_IMAGE_TEXT and len(doc.media) == 2
    text = TOK.decode(doc.tokens_L.tolist())
    assert text.startswith("<|bos|>one<|image_start|>") and "<|image_end|>two<|image_start|>" in text
    assert doc.span_L.max() == 1
    obelics = {"texts": ["hello", None, "bye"], "images": [None, "0.png", None]}
    kind, (doc2,) = _docs(_raw(json=obelics, **{"0_png": image_bytes(8, 8)}))
    assert TOK.decode(doc2.tokens_L.tolist()).startswith("<|bos|>hello<|image_start|>")


def test_text_document_and_chunking():
    kind, (doc,) = _docs(_raw(txt="hi there"))
    assert kind == "text" and doc.task == TASK_TEXT
    assert doc.tokens_L.tolist() == [S.bos, *b"hi there", S.eos]
    assert doc.labels_L.tolist() == [*b"hi there", S.eos, IGNORE_INDEX]
    text = "".join(chr(97 + i % 26) for i in range(150))
    _, docs = _docs(_raw(txt=text), seq_len=64)
    assert [len(d) for d in docs] == [64, 64, 24]
    assert np.concatenate([d.tokens_L for d in docs]).tolist() == [S.bos, *text.encode(), S.eos]
    assert all(d.pos_3L[0, 0] == 0 for d in docs)  # positions restart per chunk


def test_budget_shrinks_media_then_truncates_text():
    media = small_media(min_pixels=8 * 8, max_pixels=32 * 32)  # 32x32: 4 x 4 = 16 placeholders
    raw = _raw(png=image_bytes(32, 32), txt="caption")
    _, (doc,) = _docs(raw, seq_len=20, media=media)
    assert len(doc) <= 20 and doc.media[0].grid_thw == (1, 4, 4)  # shrunk to 16x16, caption whole
    assert TOK.decode(doc.tokens_L.tolist()).endswith("caption<|eos|>")
    _, (doc,) = _docs(_raw(png=image_bytes(32, 32), txt="x" * 50), seq_len=24, media=media)
    assert len(doc) == 24 and doc.media[0].grid_thw == (1, 2, 2)  # min_pixels, then text cut
    assert doc.tokens_L[-1] == S.eos
    big = small_media(min_pixels=32 * 32, max_pixels=32 * 32)
    assert _skip(raw, seq_len=16, media=big) == "too_long"


def test_budget_cuts_interleaved_at_a_segment_boundary():
    media = small_media(min_pixels=16 * 16, max_pixels=16 * 16)  # 4 placeholders per image
    segs = {"segments": [{"text": "aaaa"}, {"image": "0.png"}, {"text": "bbbb"}, {"image": "1.png"}]}
    raw = _raw(json=segs, **{"0_png": image_bytes(16, 16), "1_png": image_bytes(16, 16)})
    _, (doc,) = _docs(raw, seq_len=18, media=media)
    assert TOK.decode(doc.tokens_L.tolist()).count("<|image_start|>") == 1 and len(doc.media) == 1


@pytest.mark.parametrize(("members", "reason"), [
    (dict(png=b"", txt="x"), "corrupt_image"),
    (dict(png=image_bytes(8, 8)), "missing_member"),
    (dict(json={"segments": [{"text": "a"}, {"image": "3.png"}]}), "missing_member"),
    (dict(json=b"{not json"), "bad_json"),
    (dict(json={"segments": [{"text": "a", "image": "0.png"}]}), "bad_json"),
    (dict(json={"texts": ["a"], "images": []}), "bad_json"),
    (dict(txt=b"\xff\xfe"), "bad_text"),
    (dict(txt="   "), "empty_text"),
    (dict(mp4=b"junk", txt="x"), "corrupt_video"),
    (dict(cls=b"3"), "unknown_kind"),
])
def test_bad_samples_raise_skip_with_reason(members, reason):
    assert _skip(_raw(**members)) == reason


class _Matching(ByteTokenizer):
    """Like HF tokenizers with added special tokens: "<|image_pad|>" in text encodes to its id."""

    def encode(self, text):
        head, sep, tail = text.partition("<|image_pad|>")
        return super().encode(head) + ([self.special.image_pad] + self.encode(tail) if sep else [])


def test_special_tokens_spelled_in_text_do_not_become_placeholders():
    tok = _Matching()
    raw = _raw(png=image_bytes(16, 16), txt="look <|image_pad|> here")
    _, (doc,) = make_documents(raw, tok, data_cfg())
    assert int((doc.tokens_L == S.image_pad).sum()) == sum(doc.media_tokens) and len(doc.media) == 1
    assert TOK.decode(doc.tokens_L.tolist()).endswith("look  here<|eos|>")
