import argparse
import json

from dp_shards import bad_shards, make_folder, make_jsonl

from mmtrain.data_pipelines import inspect, write


def _parse(module, *argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args([str(a) for a in argv])


def test_write_then_inspect_counts_exactly(tmp_path, capsys):
    out = tmp_path / "shards"
    make_folder(tmp_path / "folder")
    jsonl, _ = make_jsonl(tmp_path / "jl")
    assert write.run(_parse(write, "--from", "folder", tmp_path / "folder", "--out", out, "--prefix", "f",
                            "--shard-size", "2")) == 0
    assert write.run(_parse(write, "--from", "jsonl", jsonl, "--out", out, "--prefix", "j")) == 0
    _, expected_bad = bad_shards(out)  # bad.tar (2 good, 8 bad), cut.tar (1 good), empty.tar
    capsys.readouterr()
    args = _parse(inspect, out, "--seq-len", 128, "--json", "--max-image-pixels", 48 * 48,
                  "--min-pixels", 256, "--max-pixels", 1024)
    assert inspect.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shards"] == 3 + 1 + 3
    counts = {k: v["samples"] for k, v in report["kinds"].items()}
    # folder: cat, dog | clip | note | story; jsonl: x | v | plain | segments; bad.tar; cut.tar
    assert counts == {"image": 2 + 1 + 1, "video": 1 + 1, "text": 1 + 1 + 1 + 1, "interleaved": 1 + 1}
    reasons = {}
    for _, _, r in expected_bad:
        reasons[r] = reasons.get(r, 0) + 1
    assert report["bad"] == reasons and sum(reasons.values()) == 10
    assert report["good"] == 12 and report["samples"] == 12 + 10
    assert report["tokens"]["visual"] == sum(v["visual_tokens"] for v in report["kinds"].values()) > 0
    assert 0.2 < report["packing_efficiency"] <= 1.0 and report["tokens"]["max_doc"] <= 128


def test_table_output(tmp_path, capsys):
    urls, _ = bad_shards(tmp_path)
    assert inspect.run(_parse(inspect, *urls, "--seq-len", 64, "--max-image-pixels", 2000)) == 0
    text = capsys.readouterr().out
    assert "bad samples: 10" in text and "truncated_tar" in text and "packing at seq_len 64" in text
