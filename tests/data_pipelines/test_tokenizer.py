import json
import random

import pytest
from tokenizers import Tokenizer as HFTok
from tokenizers import models, pre_tokenizers

from mmtrain.data_pipelines.errors import DataError
from mmtrain.data_pipelines.synth import world
from mmtrain.data_pipelines.tokenizer import (
    SPECIAL_TOKENS,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    train_bpe,
)


def _random_text(rng: random.Random, n: int = 200) -> str:
    alphabet = "abc XYZ 019 .,!?\n\t" + "éß日本語🙂" + "red circle"
    return "".join(rng.choice(alphabet) for _ in range(n))


def _world_texts(n: int = 400) -> list[str]:
    import numpy as np

    rng = np.random.default_rng(random.randrange(2**31))
    texts = [world.image_caption(rng, world.sample_objects(rng)) for _ in range(n)]
    texts += [world.video_caption(rng, world.sample_video_objects(rng)) for _ in range(n // 4)]
    return texts + [world.text_document(rng) for _ in range(n // 4)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> HFTokenizer:
    return train_bpe(_world_texts(), 512, tmp_path_factory.mktemp("bpe") / "tokenizer.json")


def _check_specials(tok: Tokenizer) -> None:
    ids = tok.special.as_tuple()
    assert len(ids) == len(SPECIAL_TOKENS) == len(set(ids))
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert [tok.token_str(i) for i in ids] == list(SPECIAL_TOKENS)


def test_byte_round_trip_and_specials():
    tok = ByteTokenizer()
    rng = random.Random()
    for _ in range(20):
        text = _random_text(rng)
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    _check_specials(tok)
    assert tok.vocab_size == 256 + len(SPECIAL_TOKENS)
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"  # invalid UTF-8 -> replacement char
    assert tok.decode([ord("a"), tok.special.eos]) == "a<|eos|>"


def test_bpe_round_trip_and_specials(bpe):
    rng = random.Random()
    for _ in range(20):
        text = _random_text(rng)  # includes bytes never seen in training: byte-level covers them
        assert bpe.decode(bpe.encode(text)) == text
    _check_specials(bpe)


@pytest.mark.parametrize("make", [ByteTokenizer, None])
def test_special_strings_in_text_stay_text(make, bpe):
    tok = make() if make else bpe
    ids = tok.encode("a <|eos|> b<|image_pad|>")
    assert not set(ids) & set(tok.special.as_tuple())
    assert tok.decode(ids) == "a <|eos|> b<|image_pad|>"


def test_bpe_shape_words_are_single_tokens(bpe):
    words = [*world.COLOR_NAMES, *world.SHAPES, *world.SIZES, "left", "right", "top", "bottom", "center"]
    for w in words:
        ids = bpe.encode(" " + w)
        assert len(ids) == 1, (w, [bpe.token_str(i) for i in ids])
        assert bpe.token_str(ids[0]) == w  # the byte-level space marker is stripped
    pieces = [bpe.token_str(i) for i in bpe.encode("a large red circle at the top left.")]
    assert pieces == ["a", "large", "red", "circle", "at", "the", "top", "left", "."]


def test_train_bpe_is_deterministic(tmp_path):
    texts = _world_texts(200)
    train_bpe(texts, 400, tmp_path / "a.json")
    train_bpe(texts, 400, tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_load_round_trip_and_missing_specials_added(tmp_path, bpe):
    bpe.save(tmp_path / "tokenizer.json")
    loaded = load_tokenizer(str(tmp_path))  # a directory holding tokenizer.json works too
    assert loaded.vocab_size == bpe.vocab_size and loaded.special == bpe.special
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)

    bare = HFTok(models.BPE())  # no specials at all
    bare.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bare.add_tokens(["hello"])
    bare.save(str(tmp_path / "bare.json"))
    tok = load_tokenizer(tmp_path / "bare.json")
    _check_specials(tok)
    assert tok.encode("hello") == [0]


@pytest.mark.parametrize("content", [None, "{not json", '{"a": 1}', b"\xff\xfe\x00"])
def test_load_errors_are_one_line_data_errors(tmp_path, content):
    path = tmp_path / "tok.json"
    if isinstance(content, str):
        path.write_text(content)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    with pytest.raises(DataError) as e:
        load_tokenizer(str(path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_load_error_names_directory_without_tokenizer(tmp_path):
    with pytest.raises(DataError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_token_str_is_readable(bpe):
    assert ByteTokenizer().token_str(ord(" ")) == "␣"
    assert ByteTokenizer().token_str(0xC3) == "\\xc3"
    (nl,) = bpe.encode("\n")
    assert bpe.token_str(nl) == "\\n"
    assert json.dumps(bpe.token_str(bpe.encode(" red")[0])) == '"red"'
