"""Fuzz: a corpus of 50+ kinds of malformed and hostile samples and shards (fuzz_corpus.py)
through `mmtrain data inspect` and the loader with 2 worker processes: no crash, no hang, every
bad sample counted once by its reason, every good sample delivered once, bounded memory.

Memory bound (per worker): what it shares with the process it was forked from (torch, PIL,
PyAV, decord: ~300 MB resident here) + the shuffle buffer's bytes + one raw sample (<=
max_member_bytes per member) + one decoded image or frame (<= 3 x max_image_pixels bytes) + the
held media (<= max_media_per_doc x video_max_frames frames at twice the resize target). With
the limits below: < 300 + 2 + 0.3 x 2 + 12 + 1 MB; the test asserts a 450 MB peak (VmHWM) and
prints what it measured.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter

import pytest
import yaml
from dp_shards import children, data_cfg, rss_mb
from fuzz_corpus import LIMITS, build

from mmtrain.data_pipelines.config import MediaConfig
from mmtrain.data_pipelines.loader import build_loader
from mmtrain.data_pipelines.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
LABEL = re.compile(r"good\d{4}")
SEQ_LEN = 256
PEAK_RSS_BOUND_MB = 450
pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore:shard .*:UserWarning")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build(tmp_path_factory.mktemp("fuzz"))


def _cfg(split: str, specs: list[str], **kw):
    cfg = data_cfg(**{split: specs}, seq_len=SEQ_LEN, batch_size=4, num_workers=2, **kw)
    for key, value in LIMITS.items():
        if key.startswith("media."):
            setattr(cfg.media, key[6:], value)
        else:
            setattr(cfg, key, value)
    return cfg


def _labels(batch) -> list[str]:
    return LABEL.findall(TOK.decode(batch.tokens_BS.reshape(-1).tolist()))


def test_the_corpus_has_30_kinds_at_least(corpus):
    assert len(corpus.kinds) >= 30, sorted(corpus.kinds)
    print(f"\n{len(corpus.kinds)} kinds, {len(corpus.good)} good samples, {len(corpus.bad)} bad: "
          f"{dict(Counter(r for _, _, r in corpus.bad))}")


def test_loader_with_two_workers_counts_every_bad_sample_once(corpus):
    loader = build_loader(_cfg("val", corpus.specs), TOK, "val")
    labels = [name for batch in loader for name in _labels(batch)]
    assert sorted(labels) == sorted(corpus.good)  # each good sample exactly once
    assert sorted(loader.ledger.entries) == sorted(corpus.bad)  # each bad one once, with its reason
    st = loader.stats()
    assert st["skipped"] == dict(Counter(r for _, _, r in corpus.bad))


def test_inspect_reports_the_same(corpus, capsys):
    from mmtrain.cli import main

    m = MediaConfig(patch_size=4, merge=2, min_pixels=64, max_pixels=256)  # data_cfg's small_media
    args = ["data", "inspect", *corpus.specs, "--json", "--seq-len", str(SEQ_LEN), "--patch-size", "4",
            "--merge", "2", "--min-pixels", str(m.min_pixels), "--max-pixels", str(m.max_pixels),
            "--show-bad", "1000"]
    media_keys = {"video_fps": 4.0, "video_max_frames": 4}
    for key, value in {**LIMITS, **{f"media.{k}": v for k, v in media_keys.items()}}.items():
        args += ["--set", f"{key}={yaml.safe_dump(value).splitlines()[0]}"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["good"] == len(corpus.good)
    assert report["bad"] == dict(sorted(Counter(r for _, _, r in corpus.bad).items()))
    assert sorted(map(tuple, report["bad_examples"])) == sorted(corpus.bad)


def test_training_loader_delivers_everything_within_a_memory_bound(corpus):
    cfg = _cfg("train", corpus.specs, shuffle_buffer=8, shuffle_buffer_bytes=2 << 20)
    loader = build_loader(cfg, TOK, "train")
    labels, peak = Counter(), 0.0
    it = iter(loader)
    for n in range(500):  # noqa: B007 (printed below)
        labels.update(_labels(next(it)))
        peak = max([peak] + [rss_mb(pid, "VmHWM") for pid in children()])
        if set(labels) >= set(corpus.good) and set(loader.ledger.entries) >= set(corpus.bad):
            break
    del it
    assert set(labels) == set(corpus.good)
    assert set(loader.ledger.entries) == set(corpus.bad)
    print(f"\n{n + 1} batches; worker peak RSS {peak:.0f} MB (bound {PEAK_RSS_BOUND_MB} MB; this process: "
          f"{rss_mb(os.getpid(), 'VmRSS'):.0f} MB)")
    assert 0 < peak < PEAK_RSS_BOUND_MB
