"""The docs name files that exist: every repository path in README.md and docs/*.md (backticked or
in running text, e.g. models/attention/meta.py, tools/bench/bench_long.py, configs/tiny.yaml) is
in the checkout, and every backticked bare file name (`select.py`) is somewhere in it.

Not checked: runs/ and data/ (what training and `mmtrain data synth` write), placeholders
(`RUN/step_<N>`, globs, brace ranges), files a run writes (`config.yaml`), and files an experiment
writes into its docs/experiments/ folder (outputs; the folder itself must exist).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOPS = ("mmtrain", "models", "data_pipelines", "tools", "configs", "launch", "tests", "docs")
PATH = re.compile(rf"(?<![\w./<{{$-])((?:{'|'.join(TOPS)})/[\w./-]*[\w/])(?![\w<{{*])")
BARE = re.compile(r"`([\w-]+\.(?:py|md|yaml|yml|sh|sbatch|toml))`")
SKIP = ("build", ".venv", ".git", "runs", "data")
OUTPUTS = {"config.yaml"}  # the resolved config a run and each checkpoint write


def named_paths(text: str) -> list[str]:
    return [m.group(1).rstrip(".") for m in PATH.finditer(text)]


def missing(path: str) -> bool:
    if (ROOT / path).exists():
        return False
    return not (path.startswith("docs/experiments/") and (ROOT / path).parent.is_dir())


def repo_file_names() -> set[str]:
    return {p.name for p in ROOT.rglob("*") if not set(p.relative_to(ROOT).parts) & set(SKIP)}


def test_the_scanner_finds_paths_in_text_and_backticks():
    text = ("see `models/attention/meta.py` and tools/bench/bench_long.py, configs/tiny.yaml. "
            "Not runs/tiny/step_600, `RUN/step_<N>`, data/shapes or mmtrain.models.attention.")
    assert named_paths(text) == ["models/attention/meta.py", "tools/bench/bench_long.py", "configs/tiny.yaml"]
    assert missing("models/config.py") and not missing("models/decoder.py")


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_paths_named_in_docs_exist(doc):
    bad = [f"{doc.name}:{i}: {p}" for i, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
           for p in named_paths(line) if missing(p)]
    assert not bad, "docs name files that do not exist: " + ", ".join(bad)


def test_backticked_file_names_exist():
    names = repo_file_names()
    bad = [f"{doc.name}:{i}: {m}" for doc in DOCS
           for i, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
           for m in BARE.findall(line) if m not in names | OUTPUTS]
    assert not bad, "docs name files that are nowhere in the checkout: " + ", ".join(bad)
