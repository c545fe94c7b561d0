"""Atomic, reshardable checkpoints in the run directory, and loading them outside training.

`RUN/step_<N>/` (docs/DISTRIBUTED.md; what the parts are: mmtrain/state/train_state.py):

    dcp/            torch.distributed.checkpoint: model + optimizer, each rank its shards (reshardable)
    state.pt        rank 0: the replicated parts, world size, config
    rank_<r>.pt     rank r: its per-rank parts (loader state with its ledger, RNG states)
    config.yaml     the resolved run config; tokenizer.json, a copy
    manifest.json   size and SHA-256 of every file above, written last (mmtrain/state/manifest.py)

Written into `RUN/.step_<N>.tmp/`, renamed by rank 0 after a barrier, the last `keep_last` kept;
resume takes the newest that verifies (`newest_valid`); every `torch.load` is `weights_only=True`.
`save_async` stages at the step and writes in the background; `poll` (every rank, at step
boundaries) commits once all ranks' writes are done. `load_for_inference` reads a checkpoint, an
export (`mmtrain export`: model.safetensors, config.yaml, tokenizer.json) or an old single-file one.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from mmtrain.errors import UserError
from mmtrain.parallel.distributed import DistEnv, barrier, broadcast_object
from mmtrain.state.layout import upgrade
from mmtrain.state.manifest import all_gather, own_entries, verify, write_manifest

_STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "state.pt"
DCP_DIR = "dcp"
RANK_FILE = "rank_{:05d}.pt"
CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"  # a copy, so a checkpoint is usable without the corpus
WEIGHTS_FILE = "model.safetensors"  # an export's consolidated weights


@dataclass
class _Pending:
    """An asynchronous save: staged at `step`, its files being written into `tmp` in the background."""

    step: int
    tmp: Path
    written: Future  # -> this rank's manifest entries, once all its files are on disk
    before_commit: Callable[[], None] | None


class Checkpointer:
    def __init__(self, run_dir: str | Path, keep_last: int, env: DistEnv | None = None):
        self.run_dir = Path(run_dir)
        self.keep_last = keep_last
        self.env = env or DistEnv()
        self.while_writing: Callable[[int], None] | None = None  # fault injection: in the writer thread
        self._pending: _Pending | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._group = None  # the background writes' own gloo group

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        found = []
        if self.run_dir.is_dir():
            for p in self.run_dir.iterdir():
                m = _STEP_DIR.match(p.name)
                if m and (p / STATE_FILE).is_file():
                    found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        ckpts = self.checkpoints()
        return ckpts[-1] if ckpts else None

    def latest_agreed(self) -> Path | None:
        """The newest complete checkpoint as rank 0 sees it (after undoing a half-done swap),
        the same on every rank."""
        if self.env.is_main:
            self._recover()
        return broadcast_object(self.latest() if self.env.is_main else None, self.env)

    def newest_valid(self) -> tuple[Path | None, list[tuple[Path, str]]]:
        """Collective: the newest checkpoint that verifies against its manifest, and the newer
        ones skipped with why (the same on every rank). Raises if checkpoints exist but none
        verifies: starting from scratch would silently throw a run away."""
        if self.env.is_main:
            self._recover()
        found = sorted((p for p in self.run_dir.iterdir() if _STEP_DIR.match(p.name)),
                       key=lambda p: int(p.name[5:])) if self.run_dir.is_dir() else []
        skipped = []
        for path in reversed(broadcast_object(found if self.env.is_main else None, self.env)):
            why = verify(path, self.env)
            if why is None:
                return path, skipped
            skipped.append((path, why))
        if skipped:
            raise UserError(f"{self.run_dir}: no checkpoint verifies (" +
                            "; ".join(f"{p.name}: {why}" for p, why in skipped) + ")")
        return None, []

    def save(self, step: int, dcp_state: dict, shared: dict, per_rank: dict, config_text: str,
             files: dict[str, Path] | None = None, before_commit: Callable[[], None] | None = None) -> Path:
        """Collective: every rank calls it. `dcp_state` goes through torch.distributed.checkpoint,
        `shared` (rank 0's) to state.pt, `per_rank` to rank_<r>.pt; then the atomic rename."""
        import torch.distributed.checkpoint as dcp

        tmp = self._begin(step)
        with quiet_single_process():
            dcp.save(dcp_state, checkpoint_id=tmp / DCP_DIR, no_dist=not self.env.distributed)  # fsyncs files
        own = self._write_rest(tmp, self._snapshot(shared, per_rank, config_text, files))
        if before_commit is not None:
            before_commit()
        return self._commit(step, tmp, own)

    def save_async(self, step: int, dcp_state: dict, shared: dict, per_rank: dict, config_text: str,
                   files: dict[str, Path] | None = None,
                   before_commit: Callable[[], None] | None = None) -> None:
        """Collective, as `save`, but returns once the DCP state is staged (copied to CPU memory)
        and `shared`/`per_rank` are serialised: their files are written in the background while
        training goes on, and a later `poll` commits them. One save at a time."""
        import torch.distributed.checkpoint as dcp

        tmp = self._begin(step)
        snapshot = self._snapshot(shared, per_rank, config_text, files)
        if not self.env.distributed:  # DCP's writer thread says it for every save of one process
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        upload = dcp.async_save(dcp_state, checkpoint_id=tmp / DCP_DIR, process_group=self._writer_group(),
                                no_dist=not self.env.distributed)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        written = self._writer.submit(self._write_after, upload, step, tmp, snapshot)
        self._pending = _Pending(step, tmp, written, before_commit)

    def poll(self, wait: bool = False) -> Path | None:
        """Collective: commit the pending asynchronous save once every rank has written its files
        (`wait`: block until then); -> its path, or None (no save pending, or a rank still writing).
        The ranks decide on their gathered flags, not their own, so all commit at the same call."""
        pending = self._pending
        if pending is None:
            return None
        if wait:
            futures.wait([pending.written])
        flags = all_gather(_outcome(pending.written), self.env)
        if not all(done for done, _ in flags):
            return None
        self._pending = None
        failed = [f"rank {r}: {error}" for r, (_, error) in enumerate(flags) if error]
        if failed:
            raise RuntimeError(f"{pending.tmp}: the background write failed ({'; '.join(failed)})")
        if pending.before_commit is not None:
            pending.before_commit()
        return self._commit(pending.step, pending.tmp, pending.written.result())

    def _begin(self, step: int) -> Path:
        """Collective: an empty hidden directory for the save of `step`. One save at a time: a
        commit prunes every other `.step_*.tmp`."""
        if self._pending is not None:
            raise RuntimeError(f"step {step}: the save of step {self._pending.step} is not committed yet")
        tmp = self.run_dir / f".step_{step}.tmp"
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier(self.env)
        return tmp

    def _writer_group(self):
        """The background writer's collectives run beside the loop's, so on a gloo group of their
        own (torchtitan's way; gloo also serves CUDA runs, async_save needs a CPU backend)."""
        if self.env.distributed and self._group is None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        return self._group

    def _snapshot(self, shared: dict, per_rank: dict, config_text: str,
                  files: dict[str, Path] | None) -> dict[str, bytes | Path]:
        """This rank's files besides DCP's, serialised now: the parts move on with the next step."""
        out: dict[str, bytes | Path] = {RANK_FILE.format(self.env.rank): _serialised(per_rank)}
        if self.env.is_main:  # state.pt last
            out.update({CONFIG_FILE: config_text.encode(), **(files or {}), STATE_FILE: _serialised(shared)})
        return out

    def _write_after(self, upload: Future, step: int, tmp: Path, snapshot: dict[str, bytes | Path]) -> dict:
        """The writer thread: once DCP's shards are written, this rank's other files."""
        upload.result()
        if self.while_writing is not None:
            self.while_writing(step)
        return self._write_rest(tmp, snapshot)

    def _write_rest(self, tmp: Path, snapshot: dict[str, bytes | Path]) -> dict:
        """Write and fsync this rank's files besides DCP's; -> the manifest entries of all it wrote."""
        for name, data in snapshot.items():
            if isinstance(data, Path):
                shutil.copyfile(data, tmp / name)
            else:
                (tmp / name).write_bytes(data)
            _fsync(tmp / name)
        _fsync(tmp)
        return own_entries(tmp, self.env.rank)

    def _commit(self, step: int, tmp: Path, own: dict) -> Path:
        """Collective: the manifest (its gather waits for every rank's files), then rank 0 renames
        `tmp` into place and prunes; nobody reads or re-saves before the rename."""
        final = self.run_dir / f"step_{step}"
        write_manifest(tmp, self.env, own)  # last: what a later resume checks the files against
        if self.env.is_main:
            swap_in(tmp, final)
            self._prune()
        barrier(self.env)
        return final

    def _recover(self) -> None:
        """A crash between the two renames of a re-save leaves `.step_N.old` and no `step_N`."""
        if not self.run_dir.is_dir():
            return
        for old in self.run_dir.glob(".step_*.old"):
            final = old.with_name(old.name[1 : -len(".old")])
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(old, final)

    def _prune(self) -> None:
        for old in self.checkpoints()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.run_dir.glob(".step_*.tmp"):  # half-written saves of crashed launches
            shutil.rmtree(stale, ignore_errors=True)


def swap_in(tmp: Path, final: Path) -> None:
    """Rename the finished directory `tmp` to `final`; an existing `final` is kept (as
    `.<name>.old`) until the new one is in place, so a crash leaves one of them whole."""
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def tokenizer_file(spec: str | None) -> Path | None:
    """The tokenizer.json that `data.tokenizer` names (a file, or a directory holding one)."""
    if not spec or spec == "byte":
        return None
    path = Path(spec)
    path = path / TOKENIZER_FILE if path.is_dir() else path
    return path if path.is_file() else None


@contextlib.contextmanager
def quiet_single_process():
    """DCP warns on every save/load without a process group; one process is a normal case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def load_state(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """state.pt of a checkpoint: the replicated parts by name, world size and config (and, in the
    single-file checkpoints of before, everything)."""
    path = Path(path)
    file = path / STATE_FILE if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"{path}: not a checkpoint (no {STATE_FILE})")
    return _torch_load(file, map_location)


def load_rank_state(path: str | Path, rank: int) -> dict[str, Any] | None:
    file = Path(path) / RANK_FILE.format(rank)
    return _torch_load(file, "cpu") if file.is_file() else None


def load_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict of a DCP checkpoint, read in this process alone."""
    # What DCP's own format_utils.dcp_to_torch_save does: read without a state dict to fill,
    # here only the "model" entries, with no process group (works inside or outside a job).
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    root = Path(path) / DCP_DIR
    if not (root / ".metadata").is_file():
        raise UserError(f"{path}: not a checkpoint (no {DCP_DIR}/.metadata)")
    check_dcp_metadata(root)
    state: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            planner = _EmptyStateDictLoadPlanner(keys={"model"})
            _load_state_dict(state, FileSystemReader(root), planner=planner, no_dist=True)
        except BaseException as e:  # CheckpointException derives from BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise UserError(f"{path}: cannot read the model weights: {_first_line(e)}") from None
    return state["model"]


def load_for_inference(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], Path | None]:
    """(resolved config as a dict, full model state dict on CPU, tokenizer file or None).

    The entry point for consumers outside training (attention maps, evaluation, export). `path`
    is a checkpoint directory `RUN/step_<N>`, an export directory (`mmtrain export`), or a
    single-file checkpoint of the old format.
    """
    path = Path(path)
    if (path / WEIGHTS_FILE).is_file():
        return _load_export(path)
    state = load_state(path)
    if "config" not in state:
        raise UserError(f"{path}: not an mmtrain checkpoint (no config inside)")
    model = state["model"] if "model" in state else load_model_state(path)
    model = upgrade(model, state["config"].get("model", {}), state.get("layout", 1))
    tokenizer = path / TOKENIZER_FILE if path.is_dir() else None
    return state["config"], model, tokenizer if tokenizer and tokenizer.is_file() else None


def _load_export(path: Path) -> tuple[dict[str, Any], dict[str, Any], Path | None]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise UserError(f"{path}: export without {CONFIG_FILE}")
    try:
        config = yaml.safe_load(cfg_file.read_text(encoding="utf-8"))
        weights = load_file(path / WEIGHTS_FILE)
        with safe_open(path / WEIGHTS_FILE, "pt") as f:
            layout = int((f.metadata() or {}).get("layout", 1))
    except Exception as e:
        raise UserError(f"{path}: cannot read the export: {_first_line(e)}") from None
    weights = upgrade(weights, config.get("model", {}), layout)
    tokenizer = path / TOKENIZER_FILE
    return config, weights, tokenizer if tokenizer.is_file() else None


_METADATA_GLOBALS = {("collections", "OrderedDict"), ("torch.serialization", "_get_layout"),
                     ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Only what DCP's metadata holds: its own dataclasses, torch dtypes/layouts/Size, paths."""

    def find_class(self, module: str, name: str):
        ok = module.startswith("torch.distributed.checkpoint.") or (module, name) in _METADATA_GLOBALS
        if module == "torch":
            kinds = (torch.dtype, torch.layout, torch.memory_format)
            ok = name == "Size" or isinstance(getattr(torch, name, None), kinds)
        if not ok:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return super().find_class(module, name)


def check_dcp_metadata(root: Path) -> None:
    """DCP unpickles `.metadata` with plain pickle: read it first with an allowlist, so that a
    checkpoint path from the command line cannot run code."""
    try:
        with open(root / ".metadata", "rb") as f:
            _MetadataUnpickler(f).load()
    except Exception as e:
        raise UserError(f"{root / '.metadata'}: cannot read checkpoint metadata: {_first_line(e)}") from None


def _torch_load(file: Path, map_location) -> dict[str, Any]:
    """weights_only: a checkpoint path given on the command line must not run code on load.
    NumPy's RNG state (format-1 checkpoints stored it as an array) is allowed by name."""
    import numpy as np
    from numpy._core.multiarray import _reconstruct

    legacy = [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(legacy):
            return torch.load(file, map_location=map_location, weights_only=True)
    except Exception as e:  # a truncated, foreign or unsafe file: say so in one line
        raise UserError(f"{file}: cannot read checkpoint: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _serialised(obj: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _outcome(written: Future) -> tuple[bool, str | None]:
    """(done, the first line of its error or None), without waiting."""
    if not written.done():
        return False, None
    error = written.exception()
    return True, None if error is None else _first_line(error)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
