"""Bad input to `mmtrain train`: one clear error line, no traceback, non-zero exit."""

from __future__ import annotations

import os

import pytest
import yaml

from mmtrain.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


def test_missing_config(capsys, tmp_path):
    code, err = run_cli(capsys, "train", str(tmp_path / "nope.yaml"))
    assert code == 2 and err == f"mmtrain: error: {tmp_path / 'nope.yaml'}: config file not found"


def test_malformed_config(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {steps: [\n")
    code, err = run_cli(capsys, "train", str(bad))
    assert code == 2 and "not valid YAML" in err and len(err.splitlines()) == 1


def test_unknown_key_and_bad_value(capsys, make_raw, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(make_raw(tmp_path / "run")))
    code, err = run_cli(capsys, "train", str(path), "--set", "optim.lrr=1")
    assert code == 2 and f"{path}: optim.lrr: unknown key" in err
    code, err = run_cli(capsys, "train", str(path), "--set", "optim.lr=-1")
    assert code == 2 and f"{path}: optim.lr: must be > 0" in err


def test_missing_corpus(capsys, make_raw, tmp_path):
    raw = make_raw(tmp_path / "run")
    for src in raw["data"]["train"]:
        src["shards"] = [str(tmp_path / "absent" / "x-*.tar")]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    code, err = run_cli(capsys, "train", str(path))
    assert code == 2 and "absent" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()  # a run that never started leaves no directory


def test_missing_tokenizer_leaves_an_existing_run_dir_alone(capsys, make_raw, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(make_raw(tmp_path / "run")))
    code, err = run_cli(capsys, "train", str(path), "--set", f"data.tokenizer={tmp_path / 'no.json'}")
    assert code == 2 and "tokenizer file not found" in err and not (tmp_path / "run").exists()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    code, err = run_cli(capsys, "train", str(path), "--set", f"data.tokenizer={tmp_path / 'no.json'}")
    assert code == 2 and (tmp_path / "run" / "notes.txt").read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_run_dir_as_user(capsys, make_raw, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(make_raw(locked / "run")))
    code, err = run_cli(capsys, "train", str(path))
    assert code == 2 and "cannot write there" in err


def test_unwritable_run_dir(capsys, make_raw, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the run dir should go")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(make_raw(blocker / "run")))
    code, err = run_cli(capsys, "train", str(path))
    assert code == 2 and "cannot write there" in err and len(err.splitlines()) == 1
