import random

import numpy as np

from mmtrain.data_pipelines.batch import IGNORE_INDEX, IMAGE, TASK_PAD, TEXT, VIDEO
from mmtrain.data_pipelines.documents import Document
from mmtrain.data_pipelines.packing import Packer, assemble
from mmtrain.data_pipelines.preprocess import Medium

PAD, PAD_ID, P = 999, 998, 4  # pad token, media placeholder, patch dim


def _doc(uid: int, n_text: int, media: list[tuple[int, int]]) -> Document:
    """A fake document: n_text text tokens (value uid), then media given as (kind, placeholders)."""
    kinds = [TEXT] * n_text
    spans = [-1] * n_text
    meds, counts = [], []
    for j, (kind, n) in enumerate(media):
        kinds += [kind] * n
        spans += [j] * n
        # grid (1, 2, 2n) before the merge -> n placeholders; patches carry (uid, j) for tracing
        patches = np.array([[uid, j, 0, 0]] * (4 * n), np.float32)
        meds.append(Medium(kind, patches, (1, 2, 2 * n)))
        counts.append(n)
    L = len(kinds)
    tokens = np.where(np.array(kinds) == TEXT, uid, PAD_ID)
    return Document(tokens.astype(np.int64), np.full(L, uid, np.int64), np.array(kinds, np.int8),
                    np.array(spans, np.int32), np.tile(np.arange(L), (3, 1)), 0, "x", meds, counts,
                    ident=(0, (0, 0, uid), 0))


def _stream(n_docs: int, seq_len: int):
    rng = random.Random()
    docs = []
    for uid in range(n_docs):
        media = [(rng.choice([IMAGE, VIDEO]), rng.randint(1, 4)) for _ in range(rng.randint(0, 2))]
        n_text = rng.randint(1, seq_len - sum(n for _, n in media))
        docs.append(_doc(uid, n_text, media))
    return docs


def test_rows_hold_whole_documents_and_media_are_numbered_in_row_major_order():
    S, B = 32, 3
    docs = _stream(60, S)
    it = iter(docs)
    packer = Packer(S, B, lookahead=4)
    seen = []
    while (rows := packer.next_rows(lambda: next(it, None))) is not None:
        batch = assemble(rows, S, PAD, P)
        for r in range(B):
            doc_ids = batch.doc_ids_BS[r]
            n = int((doc_ids >= 0).sum())  # padding is document -1, at the end of the row
            assert (doc_ids[n:] == -1).all() and (doc_ids[:n].diff() >= 0).all()  # contiguous documents
            for d in doc_ids.unique().tolist():
                sel = doc_ids == d
                uids = batch.labels_BS[r][sel].unique().tolist()
                if uids == [IGNORE_INDEX]:
                    assert (batch.task_BS[r][sel] == TASK_PAD).all()
                    assert (batch.tokens_BS[r][sel] == PAD).all()
                    continue
                assert len(uids) == 1 and sel.sum() == len(docs[uids[0]])  # one whole document
                seen.append(uids[0])
        visual = batch.media_ids_BS >= 0
        order = batch.media_ids_BS[visual]
        assert (order[1:] >= order[:-1]).all()
        assert order.unique().tolist() == list(range(len(batch.grid_thw_M3)))
        # each medium's patches are where its number says, in the same order
        counts = (batch.grid_thw_M3.prod(-1)).tolist()
        owners = batch.patches_NP[:, :2].split(counts)
        for m, patches in enumerate(owners):
            assert (patches == patches[0]).all()
            rows_m, cols_m = (batch.media_ids_BS == m).nonzero(as_tuple=True)
            assert (batch.labels_BS[rows_m, cols_m] == int(patches[0, 0])).all()
    assert sorted(seen) == list(range(60))  # nothing lost, nothing twice


def test_a_document_that_does_not_fit_waits_first_in_line():
    S = 16
    docs = iter([_doc(0, 10, []), _doc(1, 12, []), _doc(2, 4, []), _doc(3, 3, [])])
    packer = Packer(S, 1, lookahead=4)
    rows = packer.next_rows(lambda: next(docs, None))
    assert [d.tokens_L[0] for d in rows[0]] == [0, 2]  # 1 does not fit after 0; 2 fills the gap
    rows = packer.next_rows(lambda: next(docs, None))
    assert [d.tokens_L[0] for d in rows[0]] == [1, 3]
    assert packer.next_rows(lambda: next(docs, None)) is None


def test_padding_is_its_own_document_and_spans_are_unique_per_row():
    a, b = _doc(0, 3, [(IMAGE, 2)]), _doc(1, 2, [(VIDEO, 1), (IMAGE, 1)])
    batch = assemble([[a, b]], 16, PAD, P)
    assert batch.doc_ids_BS[0].tolist() == [0] * 5 + [1] * 4 + [-1] * 7
    assert batch.span_ids_BS[0, :9].tolist() == [-1, -1, -1, 0, 0, -1, -1, 1, 2]
    assert batch.media_kind_M.tolist() == [IMAGE, VIDEO, IMAGE] and batch.patches_NP.shape == (16, P)
    assert batch.pos_ids_3BS[:, 0, 9:].tolist() == [list(range(7))] * 3
    empty = assemble([[]], 8, PAD, P)
    assert empty.patches_NP.shape == (0, P) and empty.grid_thw_M3.shape == (0, 3) and empty.num_tokens() == 0
