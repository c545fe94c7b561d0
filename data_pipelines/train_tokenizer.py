"""`mmtrain data tokenizer SPEC... --out tokenizer.json`: a byte-level BPE trained on your text.

    mmtrain data tokenizer 'shards/*.tar' --vocab-size 32000 --out data/my/tokenizer.json
    mmtrain data tokenizer docs.jsonl 'more/{000..009}.tar' --max-docs 200000 --out tok.json

Reads the text of shards (paths, globs, brace ranges, directories) or JSONL files (`texts.py`),
at most --max-docs documents and --max-bytes of text, in order; media are never decoded. The
result has the project's special tokens at the built-in tokenizer's ids (0..8, `SPECIAL_TOKENS`),
loads as `data.tokenizer`, and is a plain HF `tokenizers` file (`PreTrainedTokenizerFast`
reads it as is; `mmtrain export --hf` carries it).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from mmtrain.data_pipelines.errors import DataError
from mmtrain.data_pipelines.texts import iter_texts
from mmtrain.data_pipelines.tokenizer import SPECIAL_TOKENS, HFTokenizer, train_bpe


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sources", nargs="+",
                   help="shard specs (paths, globs, brace ranges, dirs) or *.jsonl files")
    p.add_argument("--out", required=True, help="the tokenizer.json to write")
    add_sample_arguments(p)


def add_sample_arguments(p: argparse.ArgumentParser) -> None:
    """The knobs `data config --train-tokenizer` shares."""
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="vocabulary size, special tokens included (an upper bound: a small corpus "
                        "stops earlier; default 32000)")
    p.add_argument("--max-docs", type=int, default=1_000_000, help="documents to read at most (default 1M)")
    p.add_argument("--max-bytes", type=int, default=1 << 30,
                   help="text bytes to read at most (default 1 GiB)")


def bounded(texts: Iterator[str], max_docs: int, max_bytes: int, counts: Counter,
            progress: Progress | None = None) -> Iterator[str]:
    """`texts` until max_docs documents or max_bytes UTF-8 bytes have been read; leaves the
    documents used in counts["used"] (iter_texts counts a document in "docs" as it starts it)."""
    task = progress.add_task("reading text", total=max_docs) if progress else None
    for text in texts:
        if counts["docs"] > max_docs or counts["bytes"] >= max_bytes:
            break
        counts["bytes"] += len(text.encode("utf-8"))
        counts["used"] = counts["docs"]
        if progress is not None:
            progress.update(task, completed=counts["docs"])
        yield text


def train_from(sources: list[str], out: str | Path, vocab_size: int, max_docs: int = 1_000_000,
               max_bytes: int = 1 << 30) -> tuple[HFTokenizer, Counter]:
    """Train on the bounded text of `sources`, save to `out` -> (tokenizer, counts by reason)."""
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise DataError(f"--vocab-size: must be >= {len(SPECIAL_TOKENS) + 256} (special tokens + "
                        f"the 256 bytes; got {vocab_size})")
    if max_docs < 1 or max_bytes < 1:
        raise DataError(f"--max-docs / --max-bytes: must be >= 1 (got {max_docs}, {max_bytes})")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    counts: Counter = Counter()
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=console,
                  transient=True, disable=not console.is_terminal) as progress:
        texts = bounded(iter_texts(sources, counts), max_docs, max_bytes, counts, progress)
        tmp = Path(f"{out}.tmp")
        tok = train_bpe(texts, vocab_size, tmp)
    counts["docs"] = counts.pop("used", 0)
    if counts["bytes"] == 0:
        tmp.unlink(missing_ok=True)
        raise DataError(f"no text found in {' '.join(sources)} ({_bad(counts) or 'no samples'})")
    tmp.replace(out)
    return tok, counts


def _bad(counts: Counter) -> str:
    bad = {k: v for k, v in sorted(counts.items()) if k not in ("docs", "bytes")}
    return ", ".join(f"{n} {reason}" for reason, n in bad.items())


def run(args: argparse.Namespace) -> int:
    tok, counts = train_from(args.sources, args.out, args.vocab_size, args.max_docs, args.max_bytes)
    bad = _bad(counts)
    print(f"wrote {args.out}: vocabulary {tok.vocab_size} from {counts['docs']:,} documents "
          f"({counts['bytes']:,} bytes of text); skipped: {bad or 'none'}")
    if bad:
        print(f"skipped samples by reason: {bad}", file=sys.stderr)
    return 0
