"""The docs name files that exist: every repository path in README.md and docs/*.md (backticked or
in running text, e.g. models/attention/meta.py, tools/bench/bench_long.py, configs/tiny.yaml) is
in the checkout, and every backticked bare file name (`select.py`) is somewhere in it. The
project's modules cite files that exist too: a repository path with a file extension, a bare
`*.md` name, or a doc cited by its capitalised name and a quoted section (`DESIGN "Objectives"`).

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
FILE_EXT = (".py", ".md", ".yaml", ".yml", ".sh", ".sbatch", ".toml", ".json")
MD_NAME = re.compile(r"(?<![\w./-])([\w-]+\.md)\b")
DOC_CITE = re.compile(r"\b([A-Z][A-Z_]{3,})(?=\.md\b| \")")  # DESIGN.md, DESIGN "Section"


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


def module_citations(text: str) -> list[str]:
    """Files a module's text names: repository paths with a file extension, bare *.md names, and
    docs cited by name (NAME.md)."""
    paths = [p for p in named_paths(text) if p.endswith(FILE_EXT)]
    return list(dict.fromkeys(paths + MD_NAME.findall(text) + [n + ".md" for n in DOC_CITE.findall(text)]))


def cited_missing(citation: str, names: set[str]) -> bool:
    return missing(citation) if "/" in citation else citation not in names


def project_modules() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if not set(p.relative_to(ROOT).parts) & set(SKIP)
            and p != Path(__file__).resolve()]


def test_the_module_scanner_finds_citations():
    text = 'Signals (docs: DESIGN "Objectives"), see models/attention/meta.py, `notes.md`, mmtrain/hf/X.'
    assert module_citations(text) == ["models/attention/meta.py", "notes.md", "DESIGN.md"]
    names = repo_file_names()
    assert cited_missing("DESIGN.md", names) and not cited_missing("ARCHITECTURE.md", names)


def test_modules_cite_files_in_the_checkout():
    names = repo_file_names()
    bad = [f"{p.relative_to(ROOT)}:{i}: {c}" for p in project_modules()
           for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
           for c in module_citations(line) if cited_missing(c, names)]
    assert not bad, "modules cite files that are not in the checkout: " + ", ".join(bad)


def test_every_benchmarks_section_carries_its_date():
    """docs/BENCHMARKS.md: a reader can tell how old each section's figures are."""
    lines = (ROOT / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()
    undated = [h for i, h in enumerate(lines) if h.startswith("## ")
               and not re.fullmatch(r"\*Last updated \d{4}-\d{2}-\d{2}\.\*", next(
                   (t for t in lines[i + 1:i + 4] if t.strip()), ""))]
    assert not undated, f"sections without a '*Last updated YYYY-MM-DD.*' line under the heading: {undated}"
