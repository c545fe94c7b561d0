import random
import tarfile
from pathlib import Path

import pytest
from dp_shards import text_shards, write_raw_tar, write_tar

from mmtrain.data_pipelines.errors import DataError
from mmtrain.data_pipelines.shards import ReadOptions, ShardPlan, expand_shards, expand_spec, iter_shard


def _collect(url, **kw):
    errors = []
    samples = list(iter_shard(url, on_error=lambda r, k: errors.append((r, k)), **kw))
    return samples, errors


# ----- spec expansion -------------------------------------------------------------------------
def test_brace_glob_directory_and_pipe_specs(tmp_path):
    urls = text_shards(tmp_path, 4, 1)
    assert expand_spec(str(tmp_path / "t-{000..003}.tar")) == urls
    assert expand_spec(str(tmp_path / "t-00[12].tar")) == urls[1:3]
    assert expand_spec(str(tmp_path)) == urls
    assert expand_spec("pipe:cat x-{0..1}.tar") == ["pipe:cat x-0.tar", "pipe:cat x-1.tar"]
    assert expand_shards([urls[0], str(tmp_path / "t-003.tar")]) == [urls[0], urls[3]]


def test_spec_matching_nothing_names_it(tmp_path):
    text_shards(tmp_path, 2, 1)
    with pytest.raises(DataError, match="nope-\\*.tar"):
        expand_spec(str(tmp_path / "nope-*.tar"))
    with pytest.raises(DataError, match="t-005.tar"):  # a brace range: its ends are checked
        expand_spec(str(tmp_path / "t-{000..005}.tar"))
    with pytest.raises(DataError, match="no shard specs"):
        expand_shards([], "src")


# ----- reading ----------------------------------------------------------------------------------
def test_members_group_by_key_up_to_the_first_dot(tmp_path):
    url = write_raw_tar(tmp_path / "a.tar", [("d/k1.txt", b"a"), ("d/k1.0.PNG", b"p"), ("d/k2.json", b"{}"),
                                             ("__meta__", b"x"), ("k3.txt", b"c")])
    samples, errors = _collect(url)
    assert [(s.key, sorted(s.members), s.index) for s in samples] == [
        ("d/k1", ["0.png", "txt"], 0), ("d/k2", ["json"], 1), ("k3", ["txt"], 2)]
    assert errors == []


def test_start_keep_and_stop_skip_samples_unread(tmp_path):
    url = text_shards(tmp_path, 1, 10)[0]
    samples, _ = _collect(url, start=3, keep=lambda i: i % 2 == 0, stop=8)
    assert [s.index for s in samples] == [4, 6]


def test_pipe_urls_are_read(tmp_path):
    url = text_shards(tmp_path, 1, 3)[0]
    samples, errors = _collect(f"pipe:cat {url}")
    assert len(samples) == 3 and errors == []


def test_truncated_empty_and_missing_shards_are_reported(tmp_path):
    url = write_tar(tmp_path / "full.tar", [{"__key__": f"k{i}", "txt": "x" * 2000} for i in range(5)])
    with tarfile.open(url) as tar:
        offset = [m.offset_data for m in tar][2]
    data = Path(url).read_bytes()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[: offset + 100])  # inside the 3rd sample's data: it is dropped
    samples, errors = _collect(str(cut))
    assert [s.key for s in samples] == ["k0", "k1"]
    assert errors == [("truncated_tar", "k2")]
    (tmp_path / "zero.tar").write_bytes(b"")
    assert _collect(str(tmp_path / "zero.tar")) == ([], [("empty_shard", "")])
    assert _collect(write_raw_tar(tmp_path / "none.tar", [])) == ([], [("empty_shard", "")])
    assert _collect(str(tmp_path / "gone.tar")) == ([], [("open_failed", "")])


# ----- the shard plan ---------------------------------------------------------------------------
def _epoch_samples(urls, world, nw, epoch, per_shard):
    got = []
    for rank in range(world):
        for w in range(nw):
            plan = ShardPlan(urls, "s", seed=7, rank=rank, world_size=world, worker=w, num_workers=nw)
            ord = 0
            while (url := plan.shard_at(epoch, ord)) is not None:
                got += [(url, i) for i in range(per_shard) if plan.owns(ord, i)]
                ord += 1
    return got


@pytest.mark.parametrize("n_shards", [2, 3, 9])
def test_plan_partitions_every_epoch(n_shards):
    urls = [f"s{i}.tar" for i in range(n_shards)]
    world, nw = random.choice([(2, 2), (1, 3), (3, 1)])
    for epoch in range(2):
        got = _epoch_samples(urls, world, nw, epoch, per_shard=5)
        assert sorted(got) == sorted((u, i) for u in urls for i in range(5))  # no duplicate, no drop


def test_epochs_reshuffle_and_resample_is_deterministic():
    urls = [f"s{i}.tar" for i in range(20)]
    plan = ShardPlan(urls, "s", seed=1)
    e0 = [plan.shard_at(0, o) for o in range(20)]
    assert sorted(e0) == sorted(urls) and e0 != [plan.shard_at(1, o) for o in range(20)]
    assert plan.shard_at(0, 20) is None
    rs = ShardPlan(urls, "s", seed=1, resample=True, world_size=4, rank=3, num_workers=4)
    draws = [rs.shard_at(0, o) for o in range(200)]
    assert draws == [rs.shard_at(0, o) for o in range(200)] and len(set(draws)) > 10
    assert ShardPlan(urls, "s", epochs=1).shard_at(1, 0) is None


# ----- failures: pipes, cuts, caps -------------------------------------------------------------
FAST = ReadOptions(retries=2, backoff_s=0.0, stall_timeout_s=0.5)


def test_a_failing_pipe_is_retried_from_its_next_sample_then_counted(tmp_path):
    url = text_shards(tmp_path, 1, 6)[0]
    flag = tmp_path / "tried"
    # the first try sends part of the tar, then fails; the second sends all of it
    flaky = f"pipe:if [ -e {flag} ]; then cat {url}; else touch {flag}; head -c 2600 {url}; exit 1; fi"
    samples, errors = _collect(flaky, opts=FAST)
    assert [s.index for s in samples] == list(range(6)) and errors == []
    with pytest.warns(UserWarning, match=r"exit status 3: oops \(3 tries\)"):
        samples, errors = _collect(f"pipe:cat {url}; echo oops >&2; exit 3", opts=FAST)
    assert [s.index for s in samples] == list(range(6))  # every sample once, then the failure
    assert errors == [("open_failed", "")]
    with pytest.warns(UserWarning, match="stalled"):
        assert _collect("pipe:sleep 20", opts=FAST) == ([], [("open_failed", "")])


def test_a_pipe_stopped_early_is_not_a_failure(tmp_path):
    url = text_shards(tmp_path, 1, 50)[0]
    samples, errors = _collect(f"pipe:cat {url}; sleep 20", stop=3, opts=FAST)
    assert len(samples) == 3 and errors == []


def test_a_tar_cut_at_any_member_boundary_is_reported(tmp_path):
    samples = [{"__key__": f"k{i}", "txt": f"t{i}", "json": {"i": i}} for i in range(3)]
    url = write_tar(tmp_path / "full.tar", samples)
    with tarfile.open(url) as tar:
        ends = [m.offset_data + -(-m.size // 512) * 512 for m in tar]
    data = Path(url).read_bytes()
    for n, end in enumerate(ends):  # after member n: its sample may be partial, so it is dropped
        cut = tmp_path / f"cut{n}.tar"
        cut.write_bytes(data[:end])
        got, errors = _collect(str(cut))
        assert [s.key for s in got] == [f"k{i}" for i in range(n // 2)]
        assert errors == [("truncated_tar", f"k{n // 2}")]
    (tmp_path / "junk.tar").write_bytes(b"not a tar" * 200)
    assert _collect(str(tmp_path / "junk.tar")) == ([], [("bad_shard", "")])


def test_members_over_the_cap_are_left_unread(tmp_path):
    samples = [{"__key__": "big", "txt": "x" * 5000}, {"__key__": "ok", "txt": "y"}]
    got, errors = _collect(write_tar(tmp_path / "a.tar", samples), opts=ReadOptions(max_member_bytes=1000))
    assert [(s.key, s.members, bool(s.too_large)) for s in got] == [("big", {}, True),
                                                                    ("ok", {"txt": b"y"}, False)]
    assert errors == []


def test_shard_order_is_computed_once_per_epoch(monkeypatch):
    import mmtrain.data_pipelines.shards as shards

    calls = []
    real = shards.CounterRng.permutation
    monkeypatch.setattr(shards.CounterRng, "permutation", lambda self, n: calls.append(n) or real(self, n))
    plan = ShardPlan([f"s{i}.tar" for i in range(1000)], "s", num_workers=2)
    assert len({plan.shard_at(0, o) for o in range(500)}) == 500 and calls == [1000]
