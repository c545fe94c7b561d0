"""Packing with a visual budget (data.max_media_per_row, data.max_visual_tokens_per_row): no row
exceeds either, no document is dropped (held back, packed later), the held-back count is kept, and
the loader still resumes exactly."""

import itertools
import random

import pytest
from test_loader import TOK, _mixed_cfg, _same
from test_packing import _doc

from mmtrain.data_pipelines.batch import IMAGE, VIDEO
from mmtrain.data_pipelines.loader import build_loader
from mmtrain.data_pipelines.packing import Packer


def _media_heavy(n_docs: int, seq_len: int, seed: int, max_media: int = 0, max_visual: int = 0):
    """Documents of 0-3 media of 1-4 tokens each, each alone within the budgets."""
    rng = random.Random(seed)
    docs = []
    for uid in range(n_docs):
        media = [(rng.choice([IMAGE, VIDEO]), rng.randint(1, 4)) for _ in range(rng.randint(0, 3))]
        media = media[:max_media or None]
        while max_visual and sum(n for _, n in media) > max_visual:
            media.pop()
        docs.append(_doc(uid, rng.randint(1, seq_len - 12), media))
    return docs


@pytest.mark.parametrize(("max_media", "max_visual"), [(2, 0), (0, 6), (3, 8)])
def test_rows_keep_both_budgets_and_every_document_is_packed_once(max_media, max_visual):
    S, B = 48, 3
    docs = _media_heavy(200, S, max_media * 10 + max_visual, max_media, max_visual)
    it = iter(docs)
    packer = Packer(S, B, lookahead=6, max_media=max_media, max_visual=max_visual)
    placed = []
    while (rows := packer.next_rows(lambda: next(it, None))) is not None:
        for row in rows:
            assert sum(len(d) for d in row) <= S
            assert max_media == 0 or sum(len(d.media) for d in row) <= max_media
            assert max_visual == 0 or sum(sum(d.media_tokens) for d in row) <= max_visual
            placed += [d.ident for d in row]
    assert sorted(placed) == sorted(d.ident for d in docs)  # nothing dropped, nothing twice
    assert packer.held_back > 0  # the budgets did bind (counted)


def test_no_budget_packs_as_before():
    S, B = 48, 3
    docs = _media_heavy(80, S, 1)
    got = []
    for packer in (Packer(S, B, 6), Packer(S, B, 6, max_media=0, max_visual=0)):
        it = iter(docs)
        got.append([[[d.ident for d in r] for r in rows]
                    for rows in iter(lambda p=packer, i=it: p.next_rows(lambda: next(i, None)), None)])
        assert packer.held_back == 0
    assert got[0] == got[1]


def test_a_document_over_a_budget_alone_is_an_error_not_a_hang():
    doc = _doc(0, 4, [(IMAGE, 2), (IMAGE, 2), (VIDEO, 1)])
    for kw, msg in (({"max_media": 2}, "3 media > max_media_per_row 2"),
                    ({"max_visual": 4}, "5 visual tokens > max_visual_tokens_per_row 4")):
        with pytest.raises(ValueError, match=msg):
            Packer(32, 2, 4, **kw).next_rows(iter([doc, None]).__next__)


def test_resume_is_exact_under_a_budget(tmp_path):
    cfg = _mixed_cfg(tmp_path, shuffle_buffer=5, batch_size=2, max_media_per_row=1, max_media_per_doc=1)
    loader = build_loader(cfg, TOK, "train")
    it = iter(loader)
    [next(it) for _ in range(5)]
    state = loader.state_dict()
    expected = [next(it) for _ in range(6)]
    del it
    assert all(len(set(row.tolist()) - {-1}) <= 1 for b in expected for row in b.media_ids_BS)
    resumed = build_loader(cfg, TOK, "train")
    resumed.load_state_dict(state)
    got = list(itertools.islice(resumed, 6))
    assert all(_same(a, b) for a, b in zip(expected, got)) and len(got) == 6
    assert loader.stats()["held_back"] > 0


def test_a_row_cap_below_the_document_cap_is_a_config_error():
    from mmtrain.data_pipelines.config import DataConfig

    with pytest.raises(ValueError, match="max_media_per_row: 4 < max_media_per_doc 32"):
        DataConfig(max_media_per_row=4)
    DataConfig(max_media_per_row=4, max_media_per_doc=4)


@pytest.mark.parametrize("max_visual", [1, 6])
def test_the_loader_fits_documents_to_the_visual_budget_never_raising(tmp_path, max_visual):
    """Media over the row's visual budget are scaled down, then cut at a segment, else the sample
    is skipped and counted (too_long): the packer never sees a document it could not place."""
    cfg = _mixed_cfg(tmp_path, batch_size=2, max_visual_tokens_per_row=max_visual)
    batches = list(itertools.islice(iter(build_loader(cfg, TOK, "train")), 12))
    assert len(batches) == 12
    for b in batches:
        visual_B = (b.modality_BS != 0).sum(1)
        assert int(visual_B.max()) <= max_visual
