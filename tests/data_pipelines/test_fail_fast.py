"""Fail fast, never hang: too few shards for the readers, a shard that never opens."""

import contextlib
import os
import time

import pytest
from dp_shards import data_cfg, text_shards

from mmtrain.data_pipelines import ledger as L
from mmtrain.data_pipelines.errors import DataError
from mmtrain.data_pipelines.loader import build_loader
from mmtrain.data_pipelines.shards import ReadOptions, iter_shard
from mmtrain.data_pipelines.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def test_fewer_shards_than_ranks_x_workers_is_a_one_line_error(tmp_path):
    urls = text_shards(tmp_path, 3, 4)
    cfg = data_cfg(train=urls, num_workers=2, shard_shortage="error")
    with pytest.raises(DataError) as e:
        build_loader(cfg, TOK, "train", rank=1, world_size=2)
    msg = str(e.value)
    assert "\n" not in msg and "3 shard(s) < ranks x workers = 2 x 2 = 4" in msg, msg
    build_loader(data_cfg(train=urls, num_workers=1, shard_shortage="error"), TOK, "train", 0, 3)  # 3 >= 3


def test_fewer_shards_split_by_sample_is_stated(tmp_path):
    urls = text_shards(tmp_path, 3, 4)
    stated = r"3 shard\(s\) < ranks x workers = 2 x 2 = 4: every reader reads all"
    with pytest.warns(UserWarning, match=stated):
        build_loader(data_cfg(val=urls, num_workers=2), TOK, "val", rank=0, world_size=2)
    cfg = data_cfg(train=urls, num_workers=2, resample=True, shard_shortage="error")
    build_loader(cfg, TOK, "train", 0, 2)  # resampling serves any reader count: no error


@pytest.fixture
def hung():
    """make(path): a FIFO nobody writes to there (open(path, "rb") blocks forever). Afterwards a
    writer opens each once, so the thread left waiting in open() ends."""
    paths = []

    def make(path):
        os.mkfifo(path)
        paths.append(path)
        return str(path)

    yield make
    for path in paths:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.timeout(30)  # without the open timeout this hangs: fail, not wait 10 min
def test_a_shard_that_never_opens_is_counted_and_skipped(tmp_path, hung):
    errors = []
    t0 = time.perf_counter()
    url = hung(tmp_path / "hung.tar")
    got = list(iter_shard(url, on_error=lambda r, k: errors.append(r), opts=ReadOptions(open_timeout_s=0.3)))
    assert got == [] and errors == [L.OPEN_FAILED] and time.perf_counter() - t0 < 10


@pytest.mark.timeout(30)
def test_the_loader_reads_past_a_hung_shard(tmp_path, hung):
    urls = text_shards(tmp_path, 3, 5)
    os.remove(urls[1])
    hung(urls[1])  # the middle of a brace range is not stat-ed up front: found when read
    cfg = data_cfg(val=[str(tmp_path / "t-{000..002}.tar")], open_timeout_s=0.3)
    loader = build_loader(cfg, TOK, "val")
    batches = list(loader)
    st = loader.stats()
    assert batches and st["skipped"] == {L.OPEN_FAILED: 1} and st["sources"]["v"]["ok"] == 10
