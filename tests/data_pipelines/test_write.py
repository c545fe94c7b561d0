import argparse
import json
import tarfile

import pytest
from dp_shards import make_folder, make_jsonl

from mmtrain.data_pipelines import write
from mmtrain.data_pipelines.errors import DataError


def _run(*argv) -> int:
    p = argparse.ArgumentParser()
    write.add_arguments(p)
    return write.run(p.parse_args(list(argv)))


def _members(out) -> dict[str, list[str]]:
    return {p.name: tarfile.open(p).getnames() for p in sorted(out.glob("*.tar"))}


def test_folder_to_shards(tmp_path, capsys):
    make_folder(tmp_path / "src")
    src, out_dir = str(tmp_path / "src"), str(tmp_path / "out")
    assert _run("--from", "folder", src, "--out", out_dir, "--shard-size", "2") == 0
    out = capsys.readouterr()
    assert "wrote 5 samples in 3 shards" in out.out and "orphan" in out.err
    names = sorted(n for ms in _members(tmp_path / "out").values() for n in ms)
    assert len(names) == 10  # cat 2, clip 2, dog 3 (png, txt, json), note 1, story 2; orphan skipped
    assert {n.split(".", 1)[1] for n in names} == {"txt", "jpg", "png", "json", "mp4", "1.png"}
    assert "000000002.png" in names  # the extension is lower-cased
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_jsonl_to_shards_and_strict(tmp_path, capsys):
    path, good = make_jsonl(tmp_path / "src")
    assert _run("--from", "jsonl", str(path), "--out", str(tmp_path / "out"), "--prefix", "j") == 0
    assert f"wrote {good} samples in 1 shards" in capsys.readouterr().out
    names = _members(tmp_path / "out")["j-000000.tar"]
    assert sorted(names) == sorted(["000000000.txt", "000000001.webp", "000000001.txt", "000000001.json",
                                    "000000002.mp4", "000000002.txt", "000000003.0.png", "000000003.2.mp4",
                                    "000000003.json"])
    with tarfile.open(tmp_path / "out" / "j-000000.tar") as tar:
        meta = json.loads(tar.extractfile("000000003.json").read())
    assert meta == {"segments": [{"image": "0.png"}, {"text": "after"}, {"video": "2.mp4"}]}
    assert _run("--from", "jsonl", str(path), "--out", str(tmp_path / "o2"), "--strict") == 1


def test_bad_sources_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="not a directory"):
        _run("--from", "folder", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    with pytest.raises(DataError, match="file not found"):
        _run("--from", "jsonl", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o"))


def _samples(out) -> list[tuple[str, bytes]]:
    """(key, txt) of every sample in every shard of `out`."""
    found = []
    for path in sorted(out.glob("*.tar")):
        with tarfile.open(path) as tar:
            found += [(m.name.split(".", 1)[0], tar.extractfile(m).read())
                      for m in tar if m.name.endswith(".txt")]
    return found


def test_writing_twice_keeps_the_first_set(tmp_path, capsys):
    path, good = make_jsonl(tmp_path / "src")
    out = tmp_path / "out"
    assert _run("--from", "jsonl", str(path), "--out", str(out), "--shard-size", "2") == 0
    first = _samples(out)
    assert _run("--from", "jsonl", str(path), "--out", str(out), "--shard-size", "2") == 0
    assert "numbering continues" in capsys.readouterr().err
    both = _samples(out)
    assert set(first) <= set(both) and len(both) == 2 * len(first)
    assert len({key for key, _ in both}) == len(both)  # keys stay unique across the two calls
    assert _run("--from", "jsonl", str(path), "--out", str(out), "--shard-size", "2", "--overwrite") == 0
    assert sorted(_samples(out)) == sorted(first)  # --overwrite: only the new set, no stale shard
