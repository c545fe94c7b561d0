"""`mmtrain data tokenizer`: a BPE from the user's own shards and JSONL files."""

import argparse
import json

import pytest
from dp_shards import bad_shards, image_bytes, write_tar

from mmtrain.data_pipelines import train_tokenizer
from mmtrain.data_pipelines.errors import DataError
from mmtrain.data_pipelines.tokenizer import SPECIAL_TOKENS, load_tokenizer, train_bpe

TEXTS = ["a heron stands in the reeds", "zwei Störche über dem Fluss", "猫が窓辺で眠る 🙂",
         "the heron flies <|eos|> over the river", "tabs\tand\nnewlines stay"]


def _corpus(root):
    """Image-text and interleaved shards plus a JSONL file, together holding TEXTS."""
    shard = write_tar(root / "img-000000.tar", [
        {"__key__": f"k{i}", "png": image_bytes(8, 8), "txt": t} for i, t in enumerate(TEXTS[:3])])
    doc = {"segments": [{"text": TEXTS[3]}, {"image": "0.png"}]}
    inter = write_tar(root / "doc-000000.tar", [{"__key__": "d0", "json": doc, "0.png": image_bytes(8, 8)}])
    jsonl = root / "more.jsonl"
    jsonl.write_text(json.dumps({"text": TEXTS[4]}) + "\n" + "{not json\n", encoding="utf-8")
    return [shard, inter, str(jsonl)]


def _run(*argv) -> int:
    p = argparse.ArgumentParser()
    train_tokenizer.add_arguments(p)
    return train_tokenizer.run(p.parse_args(list(argv)))


def test_trained_tokenizer_round_trips_and_keeps_special_ids(tmp_path, capsys):
    out = tmp_path / "tok" / "tokenizer.json"
    assert _run(*_corpus(tmp_path), "--vocab-size", "300", "--out", str(out)) == 0
    assert "1 bad_json" in capsys.readouterr().out  # the bad JSONL line is counted, not fatal
    tok = load_tokenizer(out)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    other = train_bpe(["something else entirely"] * 3, 280, tmp_path / "other.json")
    assert tok.special == other.special  # the built-in corpus's tokenizer is a train_bpe too
    assert tok.vocab_size <= 300


def test_transformers_loads_it_with_the_same_ids(tmp_path):
    from transformers import PreTrainedTokenizerFast

    out = tmp_path / "tokenizer.json"
    train_tokenizer.train_from(_corpus(tmp_path), out, 300)
    ours, hf = load_tokenizer(out), PreTrainedTokenizerFast(tokenizer_file=str(out))
    for text in TEXTS[:3] + TEXTS[4:]:  # TEXTS[3] holds a special token's string: text to us only
        assert hf(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert hf.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(ours.special.as_tuple())


def test_reads_a_bounded_sample(tmp_path):
    early = [{"__key__": f"a{i}", "txt": "aaaa aaaa aaaa"} for i in range(5)]
    late = [{"__key__": f"z{i}", "txt": "zzzz zzzz zzzz"} for i in range(5)]
    shard = write_tar(tmp_path / "s.tar", early + late)
    tok, counts = train_tokenizer.train_from([shard], tmp_path / "t.json", 400, max_docs=5)
    assert counts["docs"] == 5
    assert tok.hf.token_to_id("aaaa") is not None and tok.hf.token_to_id("zzzz") is None
    tok, counts = train_tokenizer.train_from([shard], tmp_path / "t.json", 400, max_bytes=20)
    assert counts["docs"] == 2 and tok.hf.token_to_id("zzzz") is None


def test_bad_input_is_counted_or_one_error(tmp_path):
    shards, expected = bad_shards(tmp_path)
    tok, counts = train_tokenizer.train_from(shards, tmp_path / "t.json", 300)
    assert tok.decode(tok.encode("fine")) == "fine"
    for reason in ("bad_json", "bad_text", "empty_text", "truncated_tar", "empty_shard"):
        assert counts[reason] >= 1, reason
    with pytest.raises(DataError, match="matches nothing"):
        train_tokenizer.train_from([str(tmp_path / "none-*.tar")], tmp_path / "t.json", 300)
    with pytest.raises(DataError, match="no text found"):
        train_tokenizer.train_from([str(tmp_path / "empty.tar")], tmp_path / "u.json", 300)
    assert not (tmp_path / "u.json").exists()
    with pytest.raises(DataError, match="vocab-size"):
        train_tokenizer.train_from(shards, tmp_path / "t.json", 10)
