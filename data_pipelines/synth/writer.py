"""Write the shapes-world corpus: shards, a BPE tokenizer trained on the train texts, a manifest.

Layout under OUT (paths in the manifest are relative to OUT):
    tokenizer.json, manifest.json, {train,val}/{image,video,interleaved,text}-NNNNNN.tar

Same config (seed included) => byte-identical files, whatever `workers` is: every sample has
its own RNG, tar headers carry fixed mtime/owner, and the mp4/png encoders are deterministic.

Writing into a non-empty OUT replaces only the files listed above; shards of this naming
pattern left over from an earlier, bigger corpus are deleted (a `train/image-*.tar` glob must
not pick them up); any other file is left alone. Each file is written to `<name>.tmp` first
and renamed, so an interrupted run never leaves a half-written shard under its final name.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import webdataset as wds

from mmtrain.data_pipelines.errors import DataError
from mmtrain.data_pipelines.synth.config import KINDS, SPLITS, SynthConfig
from mmtrain.data_pipelines.synth.render import decord_reads, video_codec
from mmtrain.data_pipelines.synth.samples import Sample, make_samples
from mmtrain.data_pipelines.tokenizer import train_bpe

FORMAT = "mmtrain-synth/1"
_SHARD_RE = re.compile(r"^(image|video|interleaved|text)-\d{6}\.tar(\.tmp)?$")


@dataclass(frozen=True)
class ShardTask:
    split: str
    kind: str
    shard: int
    start: int  # sample indices [start, stop)
    stop: int

    @property
    def relpath(self) -> str:
        return f"{self.split}/{self.kind}-{self.shard:06d}.tar"


def plan_shards(cfg: SynthConfig) -> list[ShardTask]:
    tasks = []
    for split in SPLITS:
        for kind in KINDS:
            n = cfg.count(split, kind)
            for shard, start in enumerate(range(0, n, cfg.shard_size)):
                tasks.append(ShardTask(split, kind, shard, start, min(start + cfg.shard_size, n)))
    return tasks


def write_shard(out: Path, task: ShardTask, samples: list[Sample]) -> int:
    """Write one shard (via <name>.tmp, then rename); returns its size in bytes."""
    path = out / task.relpath
    tmp = path.with_name(path.name + ".tmp")
    try:
        # Fixed mtime and owner: TarWriter otherwise stamps each member with time.time().
        tar_opts = dict(encoder=False, mtime=0, user="mmtrain", group="mmtrain")
        with open(tmp, "wb") as f, wds.TarWriter(f, **tar_opts) as w:
            for key, members, _ in samples:
                w.write({"__key__": key, **members})
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def _write_all(out: Path, cfg: SynthConfig, tasks: list[ShardTask]) -> tuple[list[str], list[int]]:
    """Write every shard; returns (train texts in task and sample order, shard sizes)."""
    texts: list[str] = []
    sizes: list[int] = []
    for task, samples in zip(tasks, _compute(cfg, tasks)):
        sizes.append(write_shard(out, task, samples))
        if task.split == "train":
            texts.extend(t for _, _, sample_texts in samples for t in sample_texts)
    return texts, sizes


def _compute(cfg: SynthConfig, tasks: list[ShardTask]) -> Iterator[list[Sample]]:
    """Each task's samples, in task order. Workers only render and encode (they import neither
    webdataset nor torch, so spawning them is cheap); this process writes the tars."""
    args = [(cfg, t.split, t.kind, t.start, t.stop) for t in tasks]
    n = min(cfg.workers or min(os.cpu_count() or 1, 8), len(tasks))
    if n <= 1:
        yield from (make_samples(*a) for a in args)
        return
    # Spawned, not forked: the parent may hold threads (torch, tokenizers). Heavy video shards
    # are submitted first so the pool does not end on one long straggler.
    order = sorted(range(len(tasks)), key=lambda i: tasks[i].kind != "video")
    pool = ProcessPoolExecutor(n, mp_context=mp.get_context("spawn"))
    try:
        futures = {i: pool.submit(make_samples, *args[i]) for i in order}
        for i in range(len(tasks)):
            yield futures.pop(i).result()  # pop: a written shard's samples can be freed
    finally:  # on an error (e.g. disk full) do not render the remaining shards first
        pool.shutdown(wait=True, cancel_futures=True)


def _prepare_out(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    try:
        for split in SPLITS:
            (out / split).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create output directory {out}: {e.strerror or e}") from None
    if not os.access(out, os.W_OK) or not all(os.access(out / s, os.W_OK) for s in SPLITS):
        raise DataError(f"output directory is not writable: {out}")
    return out


def _remove_stale(out: Path, written: set[str]) -> None:
    for split in SPLITS:
        for p in (out / split).iterdir():
            if _SHARD_RE.match(p.name) and f"{split}/{p.name}" not in written:
                p.unlink()


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _manifest(cfg: SynthConfig, tasks: list[ShardTask], sizes: list[int], vocab_size: int) -> dict:
    config = {k: v for k, v in asdict(cfg).items() if k != "workers"}  # workers do not change bytes
    return {
        "format": FORMAT,
        "seed": cfg.seed,
        "config": config,
        "tokenizer": "tokenizer.json",
        "vocab_size": vocab_size,
        "video_codec": video_codec(),
        "counts": {s: {k: cfg.count(s, k) for k in KINDS} for s in SPLITS},
        "shards": {
            s: {k: [t.relpath for t in tasks if (t.split, t.kind) == (s, k)] for k in KINDS} for s in SPLITS
        },
        "bytes": {s: sum(n for t, n in zip(tasks, sizes) if t.split == s) for s in SPLITS},
    }


def _summary(out: Path, manifest: dict, split: str) -> str:
    counts = ", ".join(f"{n} {k}" for k, n in manifest["counts"][split].items())
    n_shards = sum(len(v) for v in manifest["shards"][split].values())
    mb = manifest["bytes"][split] / 1e6
    return f"{split}: {counts} samples in {n_shards} shards ({mb:.1f} MB) -> {out / split}"


def write_corpus(out_dir: str | Path, cfg: SynthConfig, log: Callable[[str], None] | None = print) -> dict:
    """Write the corpus under out_dir and return its manifest (also saved as manifest.json)."""
    if (cfg.n_video or cfg.n_val) and not decord_reads(cfg.video_size, cfg.frames, cfg.fps):
        raise DataError(f"video_size {cfg.video_size}: decord cannot decode clips this wide; try 64")
    out = _prepare_out(out_dir)
    tasks = plan_shards(cfg)
    try:
        train_texts, sizes = _write_all(out, cfg, tasks)
        tok_tmp = out / "tokenizer.json.tmp"
        tok = train_bpe(train_texts, cfg.vocab_size, tok_tmp)
        os.replace(tok_tmp, out / "tokenizer.json")
        manifest = _manifest(cfg, tasks, sizes, tok.vocab_size)
        _write_json(out / "manifest.json", manifest)
        _remove_stale(out, {t.relpath for t in tasks})
    except OSError as e:
        raise DataError(f"cannot write corpus file {e.filename or out}: {e.strerror or e}") from None
    if log is not None:
        for split in SPLITS:
            log(_summary(out, manifest, split))
    return manifest
