"""Imports point one way (docs/ARCHITECTURE.md): no import cycles among the project's modules, and
`models/` and `data_pipelines/` import neither the trainer side nor each other.

Static, with `ast`: every `import` in a file counts, at module level or inside a function (a
function-level import only hides a cycle until the function runs); imports under `if TYPE_CHECKING:`
never run and do not count. Folders are named as installed (`models/` is `mmtrain.models`, ...); an
import of a name from a package counts as an import of that package's `__init__` unless the name is
a submodule.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def setup_roots() -> dict[str, str]:
    """setup.py's ROOTS (import name -> folder), read without running setup.py."""
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "ROOTS")
    return ast.literal_eval(node.value)


FOLDERS = {folder: name for name, folder in setup_roots().items()}  # folder -> its import name
# the one module models/ and data_pipelines/ may take from outside themselves: stdlib-only checks
LEAVES = {"mmtrain.checks"}
# Known, to be broken by their owner (then delete the entry); none at present.
KNOWN_CYCLES: list[set[str]] = []


def project_modules() -> dict[str, Path]:
    mods = {}
    for folder, name in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mod = ".".join([name, *parts])
            mods[mod] = path
    return mods


def _resolve(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (never executed: annotations only)."""
    blocks = [n for n in ast.walk(tree) if isinstance(n, ast.If)
              and getattr(n.test, "id", getattr(n.test, "attr", None)) == "TYPE_CHECKING"]
    return {id(sub) for b in blocks for stmt in b.body for sub in ast.walk(stmt)}


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `module` imports when it runs (anywhere in the file, not under
    `if TYPE_CHECKING:`)."""
    out = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node, module, path.name == "__init__.py")
            subs = {f"{target}.{a.name}" for a in node.names} & known
            out |= subs or {target}
            if len(subs) < len(node.names):
                out.add(target)
    return {m for m in out if m in known and m != module}


def import_graph() -> dict[str, set[str]]:
    mods = project_modules()
    return {m: imports_of(m, p, set(mods)) for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on_stack.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return found


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_sees_the_project():
    graph = import_graph()
    assert {"mmtrain.cli", "mmtrain.models.decoder", "mmtrain.data_pipelines.loader",
            "mmtrain.attention_maps.session"} <= set(graph)
    assert "mmtrain.attention_maps.maps" in graph["mmtrain.attention_maps.session"]  # relative
    assert "mmtrain.train" in graph["mmtrain.cli"]  # function-level


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_type_checking_imports_do_not_count(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n"
                 "def f():\n    import b\n")
    assert imports_of("m", f, {"a", "b"}) == {"b"}


def test_no_import_cycles():
    found = [c for c in cycles(import_graph()) if set(c) not in KNOWN_CYCLES]
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def trainer_subpackages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between the trainer's subpackages (mmtrain/loop/, objectives/, ...): an edge where a
    module of one imports a module of another. Top-level modules (the run config that composes
    every subsystem's config, the callback interface, the CLI) are not in it."""
    folder = ROOT / "mmtrain"
    subs = {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}

    def package(mod: str) -> str | None:
        parts = mod.split(".")
        return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in subs) else None

    mods = project_modules()
    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        a = package(mod) if mods[mod].is_relative_to(folder) else None
        if a is not None:
            out.setdefault(a, set()).update(b for d in deps if mods[d].is_relative_to(folder)
                                            and (b := package(d)) not in (None, a))
    return out


# docs/ARCHITECTURE.md's order of the trainer's subpackages, top first: a subpackage imports only
# layers below its own (it may skip some); `hf/` is imported by `inference/` alone
LAYERS = [("loop", "plan"), ("evaluation",), ("inference",), ("state",), ("objectives",), ("parallel",)]
ONLY_FROM = {"hf": {"inference"}}


def stated_order() -> str:
    return " -> ".join(", ".join(layer) for layer in LAYERS)


def order_violations(pkgs: dict[str, set[str]]) -> list[str]:
    """Edges against LAYERS / ONLY_FROM, and subpackages placed in neither."""
    level = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    bad = [f"{p}: not in the stated order (tests/test_imports.py LAYERS, docs/ARCHITECTURE.md)"
           for p in pkgs if p not in level and p not in ONLY_FROM]
    for a, deps in pkgs.items():
        for b in deps:
            if b in ONLY_FROM:
                ok = a in ONLY_FROM[b]
            else:
                ok = a in level and b in level and level[a] < level[b]
            bad += [] if ok else [f"{a} -> {b}"]
    return sorted(bad)


def test_the_trainers_subpackages_import_in_the_stated_order():
    """loop, plan -> evaluation -> inference -> state -> objectives -> parallel (each may skip
    layers), as docs/ARCHITECTURE.md states it; every subpackage is placed."""
    pkgs = trainer_subpackages(import_graph())
    assert {"loop", "plan", "objectives", "evaluation", "state", "inference", "parallel", "hf"} <= set(pkgs)
    bad = order_violations(pkgs)
    assert not bad, "imports against the stated order: " + ", ".join(bad)
    doc = " ".join((ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8").split())
    assert f"`{stated_order()}`" in doc, f"docs/ARCHITECTURE.md does not state `{stated_order()}`"


def test_the_order_check_sees_an_upward_edge_and_an_unplaced_subpackage():
    assert order_violations({"loop": {"parallel"}, "inference": {"hf"}}) == []
    assert order_violations({"parallel": {"loop"}}) == ["parallel -> loop"]
    assert order_violations({"loop": {"plan"}}) == ["loop -> plan"]  # one layer: neither imports the other
    assert order_violations({"state": {"hf"}}) == ["state -> hf"]
    assert order_violations({"new": set()})[0].startswith("new: not in the stated order")


def test_models_and_data_pipelines_import_only_themselves():
    bad = []
    for mod, deps in import_graph().items():
        for own, other in (("mmtrain.models", "mmtrain.data_pipelines"),
                           ("mmtrain.data_pipelines", "mmtrain.models")):
            if _inside(mod, own):
                bad += [f"{mod} -> {d}" for d in deps
                        if d not in LEAVES and (not _inside(d, own) or _inside(d, other))]
    assert not bad, "models/ and data_pipelines/ must not import the trainer side or each other: " + \
        ", ".join(sorted(bad))


def test_leaves_import_nothing_from_the_project():
    graph = import_graph()
    for leaf in LEAVES & set(graph):
        assert not graph[leaf], f"{leaf} must stay a leaf (stdlib only): imports {sorted(graph[leaf])}"


def test_a_folder_imported_by_its_checkout_name_fails_loudly():
    """`import models` from a checkout would load a second copy of every module (and register the
    custom ops twice): each installed folder refuses, naming the import that works."""
    import subprocess
    import sys

    for name, folder in setup_roots().items():
        if name == "mmtrain":
            continue
        run = subprocess.run([sys.executable, "-c", f"import {folder.replace('/', '.')}"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode != 0 and f"import {name}, not" in run.stderr, (folder, run.stderr[-500:])
