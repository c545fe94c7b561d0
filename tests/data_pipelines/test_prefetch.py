"""Prefetch is bounded in bytes (data.prefetch_bytes), not only in batches (prefetch_factor)."""

import time

from dp_shards import data_cfg, text_shards

from mmtrain.data_pipelines.loader import build_loader, to_wire
from mmtrain.data_pipelines.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _peak_while_the_step_is_slow(urls, prefetch_bytes: int) -> tuple[int, int, int]:
    """(peak ready bytes, bytes of one batch, samples delivered) for a consumer that stalls after
    its first batch, long enough for an unbounded worker to fill all its prefetch_factor slots."""
    cfg = data_cfg(val=urls, num_workers=1, prefetch_factor=8, prefetch_bytes=prefetch_bytes,
                   seq_len=32, batch_size=2)
    loader = build_loader(cfg, TOK, "val")
    it = iter(loader)
    first = next(it)
    time.sleep(1.5)  # the slow GPU step
    n = 1 + sum(1 for _ in it)
    assert n > 10
    return loader.prefetch_peak_bytes, to_wire(first).buf.numel(), loader.stats()["samples"]


def test_ready_batches_stay_within_the_byte_budget(tmp_path):
    urls = text_shards(tmp_path, 1, 60)  # text only: every batch has the same tensors, the same bytes
    free_peak, batch_bytes, n_free = _peak_while_the_step_is_slow(urls, 0)  # 0: batches counted only
    assert free_peak >= 4 * batch_bytes  # without a byte bound the worker ran ahead
    peak, _, n = _peak_while_the_step_is_slow(urls, 2 * batch_bytes)
    assert 0 < peak <= 2 * batch_bytes and n == n_free == 60
