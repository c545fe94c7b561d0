import itertools
import re
import warnings
from dataclasses import fields

import pytest
import torch
from dp_shards import bad_shards as make_bad_shards
from dp_shards import data_cfg, mixed_samples, text_shards, write_tar

from mmtrain.data_pipelines.config import SourceConfig
from mmtrain.data_pipelines.errors import DataError
from mmtrain.data_pipelines.loader import WorkerPipeline, _Source, build_loader
from mmtrain.data_pipelines.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _labels(batch) -> list[str]:
    """The "t-<shard>-<i>" names of the text documents in a batch."""
    text = TOK.decode(batch.tokens_BS.reshape(-1).tolist())
    return re.findall(r"<\|bos\|>([a-z]+-\d+-\d+)", text)


def _same(a, b) -> bool:
    return all(torch.equal(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))


# ----- distribution ---------------------------------------------------------------------------
@pytest.mark.parametrize("n_shards", [8, 3])  # 3 < ranks x workers: split by sample within shards
def test_ranks_and_workers_partition_an_epoch(tmp_path, n_shards):
    urls = text_shards(tmp_path, n_shards, 7)
    cfg = data_cfg(val=urls, seq_len=32, batch_size=2)
    sources = [_Source("v", urls, 1.0)]
    got = []
    for rank in range(2):
        for worker in range(2):
            pipe = WorkerPipeline(cfg, TOK, "val", sources, rank, 2, worker, 2)
            got += [name for batch, _, _ in pipe for name in _labels(batch)]
    assert sorted(got) == sorted(f"t-{s}-{i}" for s in range(n_shards) for i in range(7))


def test_real_workers_and_ranks_cover_the_val_split_once(tmp_path):
    urls = text_shards(tmp_path, 5, 6)
    cfg = data_cfg(val=urls, seq_len=32, batch_size=2, num_workers=2)
    got = [n for rank in range(2) for b in build_loader(cfg, TOK, "val", rank, 2) for n in _labels(b)]
    assert sorted(got) == sorted(f"t-{s}-{i}" for s in range(5) for i in range(6))


def test_val_is_one_deterministic_pass(tmp_path):
    write_tar(tmp_path / "m.tar", mixed_samples(12))
    loader = build_loader(data_cfg(val=[str(tmp_path / "m.tar")]), TOK, "val")
    first, second = list(loader), list(loader)
    assert len(first) == len(second) > 0 and all(_same(a, b) for a, b in zip(first, second))
    st = loader.stats()
    assert st["samples"] == 12 and st["kinds"] == {"text": 3, "image": 3, "video": 3, "interleaved": 3}
    assert 0 < st["packing_efficiency"] <= 1 and st["tokens"]["visual"] > 0 and st["media"] == 9


# ----- resume -----------------------------------------------------------------------------------
def _mixed_cfg(tmp_path, **kw):
    a = [write_tar(tmp_path / f"a{i}.tar", mixed_samples(8, tag=f"a{i}")) for i in range(2)]
    b = text_shards(tmp_path, 2, 6, prefix="b")
    cfg = data_cfg(train=a, **kw)
    cfg.train = [SourceConfig("a", a, 2.0), SourceConfig("b", b, 1.0)]
    return cfg


@pytest.mark.parametrize(("num_workers", "before"), [(0, 9), (2, 9), (2, 1)])
def test_resume_replays_exactly_the_next_batches(tmp_path, num_workers, before):
    cfg = _mixed_cfg(tmp_path, num_workers=num_workers, shuffle_buffer=5, batch_size=2)
    loader = build_loader(cfg, TOK, "train")
    it = iter(loader)
    [next(it) for _ in range(before)]  # 9 batches: about 60 documents, past the first epoch
    state = loader.state_dict()
    expected = [next(it) for _ in range(8)]
    del it
    epochs = [s["cursor"][0] for w in state["workers"] if w for s in w["sources"]]
    assert max(epochs) >= (1 if before > 1 else 0)
    resumed = build_loader(cfg, TOK, "train")
    resumed.load_state_dict(state)
    got = list(itertools.islice(resumed, 8))
    assert all(_same(a, b) for a, b in zip(expected, got)) and len(got) == 8
    assert resumed.stats()["samples"] == loader.stats()["samples"]


def test_changed_worker_count_warns_and_goes_on(tmp_path):
    cfg = _mixed_cfg(tmp_path)
    loader = build_loader(cfg, TOK, "train")
    next(iter(loader))
    cfg.num_workers = 1
    other = build_loader(cfg, TOK, "train")
    with pytest.warns(UserWarning, match="exact resume is impossible"):
        other.load_state_dict(loader.state_dict())
    assert next(iter(other)).num_tokens() > 0


# ----- bad input ----------------------------------------------------------------------------------
@pytest.fixture
def bad_shards(tmp_path):
    return make_bad_shards(tmp_path)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bad_samples_are_counted_and_recorded(tmp_path, bad_shards, num_workers):
    urls, expected = bad_shards
    cfg = data_cfg(val=urls, num_workers=num_workers)
    cfg.media.max_image_pixels = 48 * 48
    loader = build_loader(cfg, TOK, "val")
    assert sum(b.num_tokens() for b in loader) > 0
    assert sorted(loader.ledger.entries) == sorted(expected)
    reasons = {}
    for _, _, r in expected:
        reasons[r] = reasons.get(r, 0) + 1
    assert loader.stats()["skipped"] == reasons
    assert loader.state_dict()["ledger"]["counts"] == reasons


@pytest.mark.parametrize("num_workers", [0, 2])
def test_failure_rate_aborts_with_a_clear_message(tmp_path, num_workers):
    samples = [{"__key__": f"b{i}", "png": b"broken", "txt": "x"} for i in range(12)]
    samples += [{"__key__": f"g{i}", "txt": "fine"} for i in range(4)]
    url = write_tar(tmp_path / "bad.tar", samples)
    cfg = data_cfg(train=[url, url], num_workers=num_workers, max_failure_rate=0.2,
                   min_samples_for_failure_rate=5)
    with pytest.raises(DataError, match=r"samples bad .* > max_failure_rate 20.0%.*corrupt_image"):
        next(iter(build_loader(cfg, TOK, "train")))


@pytest.mark.timeout(60)
def test_too_few_samples_for_the_workers_is_an_error_not_a_hang(tmp_path):
    url = text_shards(tmp_path, 1, 3)[0]
    cfg = data_cfg(train=[url], num_workers=2)
    with pytest.raises(DataError, match="without a sample it owns"):  # rank 1, worker 1 owns none
        list(itertools.islice(build_loader(cfg, TOK, "train", rank=1, world_size=2), 4))
    cfg.resample = True  # with replacement every worker reads the one shard: fine
    assert next(iter(build_loader(cfg, TOK, "train", rank=1, world_size=2))).num_tokens() > 0


def test_missing_spec_and_empty_split_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="nothing"):
        build_loader(data_cfg(train=[str(tmp_path / "x-*.tar")]), TOK, "train")
    with pytest.raises(DataError, match="data.val: no sources"):
        build_loader(data_cfg(train=[str(tmp_path)]), TOK, "val")


def test_an_unexpected_exception_skips_the_sample_and_warns(tmp_path, monkeypatch):
    import mmtrain.data_pipelines.stream as stream

    urls = text_shards(tmp_path, 1, 5)
    real = stream.make_documents

    def flaky(raw, tok, cfg):
        if raw.key.endswith("_002"):
            raise RuntimeError("boom")
        return real(raw, tok, cfg)

    monkeypatch.setattr(stream, "make_documents", flaky)
    loader = build_loader(data_cfg(val=urls), TOK, "val")
    with pytest.warns(UserWarning, match="RuntimeError: boom"):
        names = [n for b in loader for n in _labels(b)]
    assert sorted(names) == ["t-0-0", "t-0-1", "t-0-3", "t-0-4"]
    assert [e.reason for e in loader.ledger.entries] == ["unexpected_error"]


# ----- what the state was built from --------------------------------------------------------------
def test_a_changed_shard_list_is_an_error_unless_allowed(tmp_path):
    cfg = _mixed_cfg(tmp_path)
    loader = build_loader(cfg, TOK, "train")
    next(iter(loader))
    state = loader.state_dict()
    cfg.train[1].shards = cfg.train[1].shards[:1]
    with pytest.raises(DataError, match=r"shard list of source\(s\) 'b' \(b: 2 -> 1 shards\).*allow_changed"):
        build_loader(cfg, TOK, "train").load_state_dict(state)
    cfg.allow_changed_shards = True
    other = build_loader(cfg, TOK, "train")
    with pytest.warns(UserWarning, match="restarts at its next epoch"):
        other.load_state_dict(state)
    assert next(iter(other)).num_tokens() > 0


def test_changed_weights_warn_and_keep_the_positions(tmp_path):
    cfg = _mixed_cfg(tmp_path)
    loader = build_loader(cfg, TOK, "train")
    next(iter(loader))
    cfg.train[0].weight = 5.0
    other = build_loader(cfg, TOK, "train")
    with pytest.warns(UserWarning, match="mixing"):
        other.load_state_dict(loader.state_dict())
    assert other.state_dict()["workers"] == loader.state_dict()["workers"]


def test_resume_is_exact_inside_long_texts_with_a_byte_bounded_buffer(tmp_path):
    samples = [{"__key__": f"L{i}", "txt": f"t-0-{i} " + "abcdefgh" * (20 + 7 * i)} for i in range(12)]
    url = write_tar(tmp_path / "long.tar", samples)
    cfg = data_cfg(train=[url, url], num_workers=2, shuffle_buffer=50, shuffle_buffer_bytes=600)
    loader = build_loader(cfg, TOK, "train")
    it = iter(loader)
    [next(it) for _ in range(7)]
    state = loader.state_dict()
    assert any(s["chunks"] for w in state["workers"] for s in w["sources"])  # saved inside a text
    assert all(len(s["buffer"]) < 50 for w in state["workers"] for s in w["sources"])  # bytes bound it
    expected = [next(it) for _ in range(6)]
    del it
    resumed = build_loader(cfg, TOK, "train")
    resumed.load_state_dict(state)
    assert all(_same(a, b) for a, b in zip(expected, itertools.islice(resumed, 6)))


# ----- weights changed while training (the mixture controller) -------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_new_weights_take_effect_and_resume_exactly(tmp_path, num_workers):
    """Weights changed after 4 batches: the next batches follow them, none is lost or repeated, and a
    loader resumed from the state at the change (with the new weights set first, as the controller's
    checkpoint part does) yields exactly the same batches."""
    cfg = _mixed_cfg(tmp_path, num_workers=num_workers, shuffle_buffer=5, batch_size=2)
    loader = build_loader(cfg, TOK, "train")
    it = iter(loader)
    [next(it) for _ in range(4)]
    assert loader.set_weights({"a": 2.0}) is False  # unchanged: the running iterator may go on
    assert loader.set_weights({"b": 50.0}) is True
    state = loader.state_dict()  # a checkpoint at this step
    it = iter(loader)  # what the trainer does after a change
    after = [next(it) for _ in range(6)]
    del it
    assert state["fingerprint"]["mixing"]["weights"] == {"a": 2.0, "b": 50.0}
    resumed = build_loader(cfg, TOK, "train")
    resumed.set_weights({"b": 50.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same weights as saved: no "mixture changed" warning
        resumed.load_state_dict(state)
    got = list(itertools.islice(resumed, 6))
    assert all(_same(x, y) for x, y in zip(after, got)) and len(got) == 6
    # the change took effect: source b (weight 50 vs 2) supplies nearly every new document
    new_b = resumed.stats()["sources"]["b"]["docs"] - _docs(state, 1)
    new_a = resumed.stats()["sources"]["a"]["docs"] - _docs(state, 0)
    assert new_b > 5 * max(new_a, 1)


def _docs(state: dict, source: int) -> int:
    return sum(w["sources"][source]["stats"]["docs"] for w in state["workers"] if w)


def test_set_weights_rejects_unknown_sources_and_bad_weights(tmp_path):
    loader = build_loader(_mixed_cfg(tmp_path), TOK, "train")
    with pytest.raises(ValueError, match="no source named"):
        loader.set_weights({"zzz": 1.0})
    with pytest.raises(ValueError, match="> 0"):
        loader.set_weights({"a": 0.0})


@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_clip_cache_changes_no_batch_over_several_epochs(tmp_path, num_workers, monkeypatch):
    """media.video_cache_mb: the same packed batches, epoch after epoch, as decoding every clip."""
    from dp_shards import video_bytes

    import mmtrain.data_pipelines.decode as decode
    from mmtrain.data_pipelines.config import MediaConfig

    monkeypatch.setattr(decode, "_CLIP_CACHE", None)
    samples = [mixed_samples(8, tag=f"s{i}") for i in range(2)]
    for j, s in enumerate(x for shard in samples for x in shard if "mp4" in x):  # each clip its own
        s["mp4"] = video_bytes(6, 32, 32, values=[(40 * j + 30 * t) % 250 for t in range(6)])
    shards = [write_tar(tmp_path / f"m{i}.tar", s) for i, s in enumerate(samples)]
    batches = {}
    for mb in (0, 4):
        media = MediaConfig(**{**data_cfg().media.__dict__, "video_cache_mb": mb})
        cfg = data_cfg(shards, seq_len=128, num_workers=num_workers, resample=True, media=media)
        it = iter(build_loader(cfg, TOK, "train", 0, 1))
        batches[mb] = [next(it) for _ in range(16)]  # 16 rows of ~16 documents: several epochs
    assert all(_same(a, b) for a, b in zip(batches[0], batches[4]))
    if num_workers == 0:  # in this process: the clips were decoded once each, then read back
        assert decode._CLIP_CACHE.hits > decode._CLIP_CACHE.misses > 0
