"""A checkpoint's integrity manifest: the size and SHA-256 of every file, written last.

`manifest.json` is the last file written into `.step_<N>.tmp/` before the rename, so a committed
checkpoint whose files do not match it was damaged afterwards (a truncated copy, a bad disk, a
partial rsync). Each rank hashes the files it wrote (its `rank_<r>.pt` and DCP shards
`__<r>_*.distcp`; rank 0 also the shared files) right after writing them, in the background
writer of an asynchronous save; on resume, each rank checks its share of the list. Checkpoints
written before manifests existed have none and are taken as they are.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from mmtrain.parallel.distributed import DistEnv

MANIFEST_FILE = "manifest.json"
VERSION = 1
# The names checkpoint.py writes a rank's files under (it imports this module, so they are spelled
# here too rather than imported back; tests/mmtrain/test_manifest.py keeps the two equal).
DCP_DIR = "dcp"
RANK_FILE = "rank_{:05d}.pt"
_ANY_RANKS = re.compile(rf"^(rank_\d+\.pt|{DCP_DIR}/__\d+_.*)$")  # files some rank writes for itself


def _entry(file: Path) -> dict:
    with open(file, "rb") as f:
        return {"size": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def _all_files(root: Path) -> list[str]:
    files = (p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    return sorted(str(p.relative_to(root)) for p in files)


def _own_files(root: Path, rank: int) -> list[str]:
    """The files this rank wrote: its data/RNG state and its DCP shards."""
    own = [RANK_FILE.format(rank)] + [f"{DCP_DIR}/{p.name}" for p in (root / DCP_DIR).glob(f"__{rank}_*")]
    return [name for name in own if (root / name).is_file()]


def own_entries(root: Path, rank: int) -> dict:
    """Size and hash of the files this rank wrote; rank 0 adds the shared ones (state.pt, config,
    DCP's .metadata...), but never another rank's, which may still be being written."""
    names = _own_files(root, rank)
    if rank == 0:
        names += [n for n in _all_files(root) if not _ANY_RANKS.match(n)]
    return {name: _entry(root / name) for name in names}


def all_gather(obj, env: DistEnv) -> list:
    """Every rank's `obj`, in rank order (the object itself in one process)."""
    if not env.distributed:
        return [obj]
    import torch.distributed as dist

    out = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def write_manifest(root: Path, env: DistEnv, own: dict) -> None:
    """Collective: every rank brings the `own_entries` of its files; rank 0 adds any file nobody
    hashed and writes the manifest."""
    hashed = all_gather(own, env)
    if not env.is_main:
        return
    files = {k: v for part in hashed for k, v in part.items()}
    for name in _all_files(root):
        if name not in files:
            files[name] = _entry(root / name)
    path = root / MANIFEST_FILE
    path.write_text(json.dumps({"version": VERSION, "files": dict(sorted(files.items()))}, indent=1))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check(root: Path, name: str, want: dict) -> str | None:
    file = root / name
    if not file.is_file():
        return f"{name} is missing"
    size = file.stat().st_size
    if size != want.get("size"):
        return f"{name} has {size} bytes, the manifest says {want.get('size')}"
    if _entry(file)["sha256"] != want.get("sha256"):
        return f"{name} does not match its checksum"
    return None


def verify(root: Path, env: DistEnv) -> str | None:
    """Collective: why the checkpoint at `root` is damaged, or None (the same answer on every rank).
    The files are checked in parallel: rank r takes every world_size-th one."""
    problem = None
    path = root / MANIFEST_FILE
    if path.is_file():
        try:
            files = json.loads(path.read_text(encoding="utf-8"))["files"]
            names = sorted(files)[env.rank :: env.world_size]
            problem = next(filter(None, (_check(root, n, files[n]) for n in names)), None)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            problem = f"{MANIFEST_FILE} is unreadable ({type(e).__name__})"
    elif not (root / "state.pt").is_file():
        problem = "no state.pt and no manifest"
    return next(filter(None, all_gather(problem, env)), None)
