"""Tokenizers: one interface, a HF `tokenizers` JSON wrapper and a byte-level fallback.

Every tokenizer carries the same special tokens (`SPECIAL_TOKENS`); the pipeline asks for them
through `Tokenizer.special`, never by string. `encode` never adds special tokens: placing
BOS/EOS and media markers is the document builder's job, and text that happens to contain a
special token's string (e.g. "<|eos|>") is encoded as plain text by both implementations.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as _HFTok
from tokenizers import decoders, models, pre_tokenizers, trainers

from mmtrain.data_pipelines.errors import DataError

SPECIAL_TOKENS = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|image_start|>",
    "<|image_end|>",
    "<|image_pad|>",
    "<|video_start|>",
    "<|video_end|>",
    "<|video_pad|>",
)


@dataclass(frozen=True)
class SpecialIds:
    pad: int
    bos: int
    eos: int
    image_start: int
    image_end: int
    image_pad: int
    video_start: int
    video_end: int
    video_pad: int

    @classmethod
    def from_lookup(cls, lookup) -> SpecialIds:
        """Build from a callable mapping a special-token string to its id (order = SPECIAL_TOKENS)."""
        return cls(*(lookup(t) for t in SPECIAL_TOKENS))

    def as_tuple(self) -> tuple[int, ...]:
        return tuple(getattr(self, f) for f in self.__dataclass_fields__)


def _visible(piece: str) -> str:
    """A label for a token piece that is readable even when it is pure whitespace."""
    stripped = piece.strip()
    if stripped:
        return stripped
    return piece.replace(" ", "␣").replace("\n", "\\n").replace("\t", "\\t") or "∅"


class Tokenizer:
    """Interface: ids are 0..vocab_size-1; `special` names the ids of SPECIAL_TOKENS."""

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def special(self) -> SpecialIds:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def token_str(self, id: int) -> str:
        """Human-readable piece for one id (attention-map labels): "red", not "Ġred"."""
        raise NotImplementedError


class HFTokenizer(Tokenizer):
    """Wraps a HF `tokenizers` Tokenizer; SPECIAL_TOKENS missing from it are added at load."""

    def __init__(self, tok: _HFTok):
        missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
        if missing:
            tok.add_special_tokens(missing)
        # Literal "<|eos|>" in a document is text, as in ByteTokenizer: only the document
        # builder places special ids.
        tok.encode_special_tokens = True
        self._tok = tok
        self._special = SpecialIds.from_lookup(tok.token_to_id)
        self._vocab_size = tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        return cls(_HFTok.from_file(str(path)))

    @property
    def hf(self) -> _HFTok:
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def special(self) -> SpecialIds:
        return self._special

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_str(self, id: int) -> str:
        piece = self._tok.decode([id], skip_special_tokens=False)
        if not piece:  # no decoder configured: fall back to the raw vocab entry
            piece = self._tok.id_to_token(id) or ""
        # Byte-level ("Ġ") and SentencePiece ("▁") word markers stand for a leading space.
        return _visible(piece.replace("Ġ", " ").replace("▁", " "))

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then SPECIAL_TOKENS; needs no file."""

    def __init__(self):
        self._special = SpecialIds(*range(256, 256 + len(SPECIAL_TOKENS)))

    @property
    def vocab_size(self) -> int:
        return 256 + len(SPECIAL_TOKENS)

    @property
    def special(self) -> SpecialIds:
        return self._special

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            out.append(self._special_str(i))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_str(self, id: int) -> str:
        id = int(id)
        if id >= 256:
            return self._special_str(id)
        if 32 <= id < 127 or id in (9, 10):
            return _visible(chr(id))
        return f"\\x{id:02x}"

    def _special_str(self, id: int) -> str:
        if not 256 <= id < self.vocab_size:
            raise ValueError(f"token id out of range: {id} (vocab_size {self.vocab_size})")
        return SPECIAL_TOKENS[id - 256]


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """Spec "byte" -> ByteTokenizer; else a tokenizer.json path (or a directory holding one)."""
    if str(spec) == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"tokenizer file not found: {path} (use a tokenizer.json path or 'byte'; "
                        "`mmtrain data tokenizer SHARDS --out tok.json` trains one on your text)")
    try:
        text = path.read_text(encoding="utf-8")
        json.loads(text)
        tok = _HFTok.from_str(text)
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read tokenizer {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"tokenizer {path} is not valid JSON: {e}") from None
    except Exception as e:  # the Rust side raises a bare Exception for schema errors
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"tokenizer {path} is not a HF tokenizers file: {first}") from None
    return HFTokenizer(tok)


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | Path) -> HFTokenizer:
    """Train a byte-level BPE on `texts` (specials first, ids 0..8) and save it to `path`."""
    tok = _HFTok(models.BPE())
    # No prefix space: "red" inside a sentence is " red" -> one "Ġred" token either way.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))
    return HFTokenizer(tok)
