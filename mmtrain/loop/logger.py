"""Run logging: TensorBoard scalars, a live progress line with ETA, a plain log file per rank and
a per-step metrics.jsonl (full-precision losses: what the resume tests compare)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RunLogger:
    """Rank 0 writes TensorBoard, metrics.jsonl and the console; every rank keeps its own text log
    (`train.log` for rank 0, `train.rank<r>.log` for the others)."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, console: bool = True,
                 rank: int = 0):
        self.enabled = console and rank == 0
        self.console = Console(stderr=False, highlight=False)
        self.total_steps = total_steps
        self._tb = None
        self._progress = None
        self._task = None
        self._metrics = None
        self._last_plain = 0.0
        name = "train.log" if rank == 0 else f"train.rank{rank}.log"
        self._logfile = open(run_dir / name, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tb"))
            self._metrics = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        console = self.enabled
        if console and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),  # the time left is in the info text: steps and scheduled events (eta.py)
                console=self.console,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)

    def image(self, step: int, tag: str, image_HW3) -> None:
        """A uint8 (H, W, 3) picture to TensorBoard (e.g. expert load by modality)."""
        if self._tb is not None:
            self._tb.add_image(tag, image_HW3, step, dataformats="HWC")

    def record(self, values: dict) -> None:
        """One JSON line per step (rank 0). After a resume the replayed steps appear again:
        the later line of a step wins."""
        if self._metrics is not None:
            self._metrics.write(json.dumps(values) + "\n")
            self._metrics.flush()

    def progress(self, step: int, info: str) -> None:
        """Update the live line; without a terminal, print a plain line at most every 10 s."""
        self._logfile.write(f"step {step}: {info}\n")
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=info)
        elif time.monotonic() - self._last_plain > 10 or step == self.total_steps:
            self._last_plain = time.monotonic()
            print(f"step {step}/{self.total_steps}  {info}", flush=True)

    def info(self, message: str) -> None:
        self._logfile.write(message + "\n")
        self._logfile.flush()
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(message)
        else:
            print(message, file=sys.stdout, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._metrics is not None:
            self._metrics.close()
        self._logfile.close()
