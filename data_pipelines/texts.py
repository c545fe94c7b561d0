"""The text of shards or JSONL files, without decoding any medium: what a tokenizer is trained on.

A shard sample gives its `.txt` (a caption or a text document) or, for an interleaved document,
the text segments of its `.json`; a JSONL line gives its "text" or its text segments (the
`mmtrain data write --from jsonl` format). Bad input is counted by the loader's reasons
(`ledger.py`), never raised: a sample without readable text is one more count.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from mmtrain.data_pipelines import ledger as L
from mmtrain.data_pipelines.decode import decode_json, decode_text
from mmtrain.data_pipelines.documents import _segments_of
from mmtrain.data_pipelines.ledger import SkipSample
from mmtrain.data_pipelines.shards import RawSample, expand_spec, iter_shard


def is_jsonl(spec: str) -> bool:
    return spec.endswith(".jsonl")


def sample_texts(raw: RawSample) -> list[str]:
    """The texts of one shard sample (raises SkipSample when it has none)."""
    if raw.too_large:
        raise SkipSample(L.TOO_LARGE, raw.too_large)
    if "txt" in raw.members:
        return [decode_text(raw.members["txt"])]
    if "json" in raw.members:
        return record_texts(decode_json(raw.members["json"]))
    raise SkipSample(L.UNKNOWN_KIND, f"members {sorted(raw.members)[:6]}")


def record_texts(rec) -> list[str]:
    """The texts of a JSON record: "text", else the text segments (both forms interleaved JSON takes)."""
    if isinstance(rec, dict) and isinstance(rec.get("text"), str):
        texts = [rec["text"]]
    else:
        texts = [v for kind, v in _segments_of(rec) if kind == "text" and isinstance(v, str)]
    texts = [t.strip() for t in texts if t.strip()]
    if not texts:
        raise SkipSample(L.EMPTY_TEXT, "no text")
    return texts


def _jsonl_texts(path: str, counts: Counter) -> Iterator[list[str]]:
    try:
        f = open(path, encoding="utf-8", errors="strict")  # noqa: SIM115 (closed below)
    except OSError:
        counts[L.OPEN_FAILED] += 1
        return
    with f:
        try:
            for line in f:
                if line.strip():
                    try:
                        yield record_texts(json.loads(line))
                    except ValueError:
                        counts[L.BAD_JSON] += 1
                    except SkipSample as e:
                        counts[e.reason] += 1
        except UnicodeDecodeError:
            counts[L.BAD_TEXT] += 1  # the rest of the file is not UTF-8


def _shard_texts(url: str, counts: Counter) -> Iterator[list[str]]:
    for raw in iter_shard(url, on_error=lambda reason, key: counts.update([reason])):
        try:
            yield sample_texts(raw)
        except SkipSample as e:
            counts[e.reason] += 1


def iter_texts(specs: list[str], counts: Counter) -> Iterator[str]:
    """Every text of `specs` in order (shard specs: paths, globs, brace ranges, dirs; or *.jsonl);
    bad samples and shards add to `counts` by reason. A spec matching nothing is a DataError."""
    for spec in specs:
        urls = [spec] if is_jsonl(spec) and Path(spec).is_file() else expand_spec(spec)
        for url in urls:
            docs = _jsonl_texts(url, counts) if is_jsonl(url) else _shard_texts(url, counts)
            for texts in docs:
                counts["docs"] += 1
                yield from texts
