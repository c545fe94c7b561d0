"""The training loop: data -> model -> per-modality losses -> AdamW, with eval and checkpoints.

The trainer is the loop and little else: the losses are the objective's (mmtrain/objectives/objective.py),
the checkpoint is its named Stateful parts (`parts()`, mmtrain/state/train_state.py), and everything
besides stepping is a callback (mmtrain/callbacks.py) called at fixed points:

    fit:  resume (in __init__) -> eval -> on_train_start
          each step: train_step (on_loss per micro-batch) -> log -> on_step_end
                     -> eval / checkpoint (on_checkpoint_written, on_checkpoint) when due
                     (train.async_save: written in the background, committed at a later step)
          after the last step (or the time limit): eval -> checkpoint -> on_train_end(summary)

One process or one torchrun rank: the model, its parallelism and a step's forward and backward are
the train module's (mmtrain/loop/train_module.py; at dist.pp > 1 this rank's pipeline stages, `trained`,
and a whole replica, `model`, gathered from them for evaluation).
Backward runs on this rank's loss share x world size (FSDP/DDP average gradients); every rank takes
the same decisions (skip a non-finite step, stop at the time limit) from the step's all-reduced sums.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from mmtrain.callbacks import Callback, Callbacks, StepStats
from mmtrain.config import to_dict
from mmtrain.data_pipelines.batch import TASK_NAMES, PackedBatch
from mmtrain.data_pipelines.config import DataConfig
from mmtrain.data_pipelines.loader import build_loader
from mmtrain.data_pipelines.tokenizer import load_tokenizer
from mmtrain.errors import UserError
from mmtrain.evaluation.captioning import CaptionEval
from mmtrain.evaluation.diagnostics_callback import Diagnostics
from mmtrain.evaluation.dist_eval import evaluate_ranks
from mmtrain.evaluation.evaluate import EvalResult
from mmtrain.loop import heartbeat
from mmtrain.loop.eta import Eta, format_eta
from mmtrain.loop.faults import FaultInjection, faults_configured
from mmtrain.loop.logger import RunLogger
from mmtrain.loop.perf import Throughput, peak_tflops
from mmtrain.loop.train_module import build_train_module
from mmtrain.objectives.balance import build_balancer
from mmtrain.objectives.contrast_donors import donor_exchange
from mmtrain.objectives.curriculum import Curriculum, stage_data
from mmtrain.objectives.mixture import MixController
from mmtrain.objectives.objective import Objective
from mmtrain.optim import build_optimizer, build_scheduler
from mmtrain.parallel.comm import Traffic
from mmtrain.parallel.dims import ParallelDims
from mmtrain.parallel.distributed import DistEnv, all_reduce, current_env, pick_device
from mmtrain.parallel.vision_balance import install as install_vision_balance
from mmtrain.run_config import RunConfig
from mmtrain.state import train_state
from mmtrain.state.checkpoint import TOKENIZER_FILE, Checkpointer, tokenizer_file
from mmtrain.state.run_dir import RESOLVED_CONFIG, prepare_run_dir
from mmtrain.state.train_state import LoaderPart, ModelPart, OptimizerPart, Parts, RNGPart, TrainState

__all__ = ["StepStats", "Trainer"]


class Trainer:
    """One run: builds model, optimizer, loaders and callbacks from `cfg`, resumes from the run
    directory's newest valid checkpoint, and `fit()`s. `callbacks` are the user's, called after the
    built-in ones (mmtrain/callbacks.py)."""

    def __init__(self, cfg: RunConfig, verbose: bool = True, env: DistEnv | None = None,
                 callbacks: Sequence[Callback] = ()):
        self.cfg = cfg
        self.env = env or current_env()
        # a silent peer is named in seconds (mmtrain/loop/heartbeat.py); sections: load, eval, checkpoint
        self.heartbeat = heartbeat.start(cfg.train.heartbeat, self.env.rank, self.env.world_size)
        self.run_dir = prepare_run_dir(cfg.run_dir)
        self.device = pick_device(cfg.train.device, self.env)
        _set_threads(cfg.train.threads, self.env)
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        _fill_vocab(cfg, self.tokenizer.vocab_size)
        self.config_text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
        if self.env.is_main:
            (self.run_dir / RESOLVED_CONFIG).write_text(self.config_text, encoding="utf-8")
        self.dims = ParallelDims.from_config(cfg.dist, self.env.world_size, self.env.rank)  # the mesh
        self.traffic = Traffic()  # bytes the expert-parallel all-to-alls move (a callback)
        train_state.seed_everything(cfg.train.seed)  # the same initial weights on every rank
        # dist.pp > 1: `model` is a whole replica for evaluation, `trained` this rank's stages (`pipeline`)
        tm = self.train_module = build_train_module(cfg, self.env, self.device, self.dims, self.traffic)
        self.raw_model, self.model, self.trained = tm.raw_model, tm.model, tm.trained
        self.pipeline, self.context = tm.pipeline, tm.context
        self.encoder = tm.encoder  # what the training forwards encode with (pp: stage 0, or None)
        self.vision_balance = install_vision_balance(self.encoder, cfg.vision, self.dims, self.traffic)
        self.optimizer = build_optimizer(self.trained, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.train.steps, cfg.optim)
        self.grad_parts = tm.grad_parts()
        self.balancer = build_balancer(cfg.loss.balancer, {t: getattr(cfg.loss, t) for t in TASK_NAMES})
        self.state = TrainState()
        self.use_train_data(stage_data(cfg.data, cfg.train.stages, 0))
        self.val_loader = build_loader(cfg.data, self.tokenizer, "val", self.dims.dp_rank, self.dims.dp_size)
        self.checkpointer = Checkpointer(self.run_dir, cfg.train.keep_last, self.env)
        self.callbacks = Callbacks([*self.builtin_callbacks(), *callbacks, *self.fault_callbacks()])
        self._mix = self.callbacks.get(MixController)
        head = tm.head  # dist.pp > 1: the LM head's stage
        self.objective = Objective(cfg, head or self.model, self.balancer, env=self.env, device=self.device,
                                   raw_model=head or self.raw_model, dp_rank=self.dims.dp_rank,
                                   cp_rank=self.dims.seq_rank, context=self.context, autocast=self.autocast,
                                   pp=self.dims.pp,
                                   donors=donor_exchange(self.dims) if cfg.loss.contrast.weight else None)
        tm.bind(self.objective)
        self._val_cache: list[PackedBatch] | None = None
        self.verbose = verbose
        self.log: RunLogger | None = None  # open during fit()
        self._t_launch = time.monotonic()
        self.resume_note: str | None = None
        with self.heartbeat.in_section("load"):
            self.resumed_from = self._resume()

    @property
    def step(self) -> int:
        """Optimizer steps done (skipped ones included)."""
        return self.state.step

    # ----- parts and callbacks -------------------------------------------------------------
    def builtin_callbacks(self) -> list[Callback]:
        """What the config asks for besides the loop (fault injection comes last, see fault_callbacks)."""
        cfg = self.cfg
        out: list[Callback] = [self.balancer, Throughput(peak_tflops(self.device, cfg.train.peak_tflops))]
        if self.dims.ep > 1 or self.dims.seq_size > 1 or cfg.vision.balance != "none":
            out.append(self.traffic)
        if self.encoder is not None and self.encoder.encode_media is not None:  # the balance's cost spread
            out.append(self.encoder.encode_media)
        if cfg.train.stages:
            out.append(Curriculum(cfg.data, cfg.train.stages, self.use_train_data))
        if cfg.diagnostics.every:
            out.append(Diagnostics(cfg.diagnostics))
        if cfg.data.mix.controller.kind != "none":
            out.append(MixController(cfg.data.mix.controller, cfg.data.train, self.set_train_weights))
        if cfg.captions.images or cfg.captions.videos:
            out.append(CaptionEval(cfg.captions, cfg.data))
        return out

    def fault_callbacks(self) -> list[Callback]:
        faults = self.cfg.train.faults
        return [FaultInjection(faults, self.env.rank)] if faults_configured(faults) else []

    def parts(self) -> Parts:
        """What a checkpoint holds, by name and by where it lives (see mmtrain/state/train_state.py)."""
        return Parts(
            sharded={"model": ModelPart(self.trained), "optim": OptimizerPart(self.trained, self.optimizer)},
            replicated={"train": self.state, "scheduler": self.scheduler,
                        **self.callbacks.parts(per_rank=False)},  # the balancer's part among them
            per_rank={"data": LoaderPart(lambda: self.train_loader), "rng": RNGPart(),
                      **self.callbacks.parts(per_rank=True)},
            data_rank=(self.dims.dp_rank, self.dims.dp_size),
        )

    def use_train_data(self, data: DataConfig) -> None:
        """(Re)build the train loader on `data` (at the start and at curriculum stage boundaries)."""
        self.train_loader = build_loader(data, self.tokenizer, "train", self.dims.dp_rank, self.dims.dp_size)
        self._train_iter = None  # the loop starts a new iterator

    def set_train_weights(self, weights: dict[str, float]) -> bool:
        """New mixture weights for the train loader (the mixture controller); -> whether they changed.
        The loop's next batch comes from a new iterator that starts where the consumed batches end."""
        changed = self.train_loader.set_weights(weights)
        if changed:
            self._train_iter = None
        return changed

    def _batches(self):
        if self._train_iter is None:
            self._train_iter = iter(self.train_loader)
        return self._train_iter

    # ----- checkpoints ---------------------------------------------------------------------
    def _resume(self) -> Path | None:
        """From the newest checkpoint that verifies; damaged newer ones are named in the log."""
        latest, skipped = self.checkpointer.newest_valid()
        notes = [f"skipped damaged checkpoint {p}: {why}" for p, why in skipped]
        self.resume_note = "; ".join(notes) or None
        if latest is None:
            return None
        try:
            note = train_state.load_checkpoint(latest, self.parts(), self.env)
            self.resume_note = "; ".join(notes + ([note] if note else [])) or None
        except (KeyError, RuntimeError, ValueError) as e:
            raise UserError(f"{latest}: checkpoint does not match this config: {e}") from None
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            if type(e).__name__ != "CheckpointException":
                raise
            raise UserError(f"{latest}: cannot load checkpoint: {str(e).splitlines()[0]}"
                            f"{self._group_hint(latest)}") from None
        return latest

    def _group_hint(self, ckpt: Path) -> str:
        """Why the optimizer state may not fit: a part's own param groups (optim.vision_* / projector_*)."""
        saved = (yaml.safe_load((ckpt / "config.yaml").read_text(encoding="utf-8")) or {}).get("optim", {})
        keys = ("vision_lr_mult", "vision_weight_decay", "projector_lr_mult", "vision_hold_steps")
        defaults = {"vision_lr_mult": 1.0, "vision_weight_decay": None, "projector_lr_mult": 1.0,
                    "vision_hold_steps": 0}
        changed = [k for k in keys if saved.get(k, defaults[k]) != getattr(self.cfg.optim, k)]
        return (f" (optim.{' / optim.'.join(changed)} differ from the checkpoint's: they add or remove a "
                f"part's own optimizer groups, so resume with the checkpoint's values)") if changed else ""

    def save_checkpoint(self, wait: bool = False) -> Path | None:
        """-> the committed checkpoint; with train.async_save (unless `wait`) None: it is staged now,
        written in the background and committed at a later step boundary. One save at a time."""
        self._acknowledge(self.checkpointer.poll(wait=True))
        tok = tokenizer_file(self.cfg.data.tokenizer)  # data.tokenizer may be a directory
        files = {TOKENIZER_FILE: tok} if tok is not None else {}
        step = self.step
        path = train_state.save_checkpoint(
            self.checkpointer, self.parts(), step, to_dict(self.cfg), self.config_text, files,
            before_commit=lambda: self.callbacks.emit("on_checkpoint_written", self, step),
            background=self.cfg.train.async_save and not wait)
        self._acknowledge(path)
        return path

    def _acknowledge(self, path: Path | None) -> None:
        """A checkpoint counts (logged, on_checkpoint) once committed; None: none was."""
        if path is not None:
            if self.log is not None:
                self.log.info(f"checkpoint {path} committed at step {self.step}")
            self.callbacks.emit("on_checkpoint", self, path)

    # ----- the loop --------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg = self.cfg.train
        self.log = RunLogger(self.run_dir, cfg.steps, self.step, console=self.verbose, rank=self.env.rank)
        self.eta = Eta(cfg.steps, {"eval": cfg.eval_every, "diagnostics": self.cfg.diagnostics.every,
                                   "checkpoint": cfg.ckpt_every}, cfg.time_limit_min * 60)
        try:
            self._announce()
            if not self.state.evals:
                self._timed("eval", self.evaluate)
            self._timed_diagnostics("on_train_start")
            while self.step < cfg.steps:
                t_step = time.monotonic()
                self.heartbeat.step_begin(self.step + 1)
                stats = self.train_step(self._batches())
                self._log_step(stats)
                events = self._timed_diagnostics("on_step_end", stats)
                self.heartbeat.step_end()
                with self.heartbeat.in_section("checkpoint"):  # a background save, once all ranks wrote it
                    self._acknowledge(self.checkpointer.poll())
                if self.is_log_step(stats):
                    self._log_callback_scalars(stats)
                if stats.time_up:
                    self.log.info(f"train.time_limit_min {cfg.time_limit_min:g} reached at step {self.step}")
                    break
                if self.step < cfg.steps and _due(self.step, cfg.eval_every):
                    events += self._timed("eval", self.evaluate)[1]
                if self.step < cfg.steps and _due(self.step, cfg.ckpt_every):
                    events += self._timed("checkpoint", self.save_checkpoint)[1]
                self.eta.step_done(time.monotonic() - t_step - events)
            return self._finish()
        finally:
            self.heartbeat.stop()
            self.log.close()
            self.log = None

    def _timed(self, kind: str, fn) -> tuple[Any, float]:
        """Run a scheduled event (evaluation, checkpoint), timing it for the ETA; -> (its result, seconds)."""
        t0 = time.monotonic()
        with self.heartbeat.in_section(kind):  # its own bound: a slow eval or save is live
            out = fn()
        seconds = time.monotonic() - t0
        self.eta.event_done(kind, seconds)
        return out, seconds

    def _timed_diagnostics(self, hook: str, *args) -> float:
        """Emit a callback hook; when the diagnostics pass ran in it, its time is an ETA event.
        -> the seconds counted as an event (0.0 otherwise)."""
        diag = self.callbacks.get(Diagnostics)
        runs = len(diag.history) if diag is not None else 0
        if diag is not None and diag.due(self, args[0] if args else None):
            self.refresh_replica()  # dist.pp > 1: the pass runs on the gathered replica
        t0 = time.monotonic()
        self.callbacks.emit(hook, self, *args)
        if diag is None or len(diag.history) == runs:
            return 0.0
        seconds = time.monotonic() - t0
        self.eta.event_done("diagnostics", seconds)
        return seconds

    def _announce(self) -> None:
        log = self.log
        if self.env.distributed:
            log.info(f"rank {self.env.rank}/{self.env.world_size} on {self.device}, {self.dims.describe()}, "
                     f"{self.cfg.dist.strategy}, {self.raw_model.num_params()}")
            log.info(self.vision_balance)
        if self.resumed_from is not None:
            log.info(f"resumed from {self.resumed_from} at step {self.step}")
        if self.resume_note and self.env.is_main:
            log.info(f"warning: {self.resume_note}")

    def _finish(self) -> dict:
        """The last eval (unless this step had one), the final checkpoint, the summary."""
        if self.state.evals[-1]["step"] != self.step:
            self._timed("eval", self.evaluate)
        path, _ = self._timed("checkpoint", lambda: self.save_checkpoint(wait=True))
        summary = self.summary(path)
        summary["wall_s"] = time.monotonic() - self._t_launch  # the end the ETA predicted (eta_check.py)
        summary["time_s"] = {"steps": self.eta.steps_s, **self.eta.totals()}  # where the wall time went
        self.callbacks.emit("on_train_end", self, summary)
        if self.env.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    # ----- one step ------------------------------------------------------------------------
    def train_step(self, train_iter) -> StepStats:
        t_start = time.perf_counter()
        self.trained.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums = self.objective.begin_step(self.step)
        self.train_module.forward_backward(train_iter, sums, lambda loss: self.callbacks.on_loss(self, loss))
        self.objective.end_backward()
        due = (self.step + 1) % self.cfg.train.log_every == 0  # a log step (see is_log_step)
        if due:
            self.grad_parts.measure_grads()  # before clipping
        norm = self.train_module.clip(self.cfg.optim.grad_clip)  # a 0-dim tensor
        sums.nonfinite = (~torch.isfinite(sums.loss + norm.double())).double()
        limit = self.cfg.train.time_limit_min
        sums.time_up = float(bool(limit) and time.monotonic() - self._t_launch > limit * 60)
        # The step's one wait for the device: the skip decision needs its sums before the update.
        total = sums.reduce(self.env, self.device).floats()
        grad_norm = float(norm)  # computed before the sums: the queue is drained already
        skipped = total.nonfinite > 0 or not math.isfinite(total.loss)
        if skipped:
            self._skip_step()
        else:
            with self.grad_parts.measure_update(due):
                self.optimizer.step()
            self.scheduler.step()
            self._after_optimizer_step()
        self.state.step += 1
        self.state.tokens_seen += int(total.tokens)
        return self.objective.end_step(total, grad_norm=grad_norm, skipped=skipped, started=t_start)

    def _skip_step(self) -> None:
        """A non-finite loss or gradient: drop the update, count it, stop if it keeps happening."""
        self.optimizer.zero_grad(set_to_none=True)
        self.state.skipped_steps += 1
        self.state.consecutive_skips += 1
        if self.state.consecutive_skips >= self.cfg.train.max_skipped_steps:
            raise UserError(
                f"{self.state.consecutive_skips} consecutive non-finite steps at step {self.step + 1}; "
                f"stopping (last checkpoint, intact: {self.checkpointer.latest()})"
            )

    def _after_optimizer_step(self) -> None:
        self.state.consecutive_skips = 0
        self.train_module.update_moe_bias()  # auxiliary-loss-free balancing on every rank's load

    def autocast(self):
        if self.device.type == "cuda" and self.cfg.train.dtype == "bfloat16":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ----- eval and logging --------------------------------------------------------------
    def val_batches(self) -> list[PackedBatch]:
        """This rank's held-out batches, read once: every evaluation sees exactly the same tokens."""
        if self._val_cache is None:
            limit = self.cfg.train.eval_batches or None
            self._val_cache = []
            for batch in self.val_loader:
                self._val_cache.append(batch)
                if limit and len(self._val_cache) >= limit:
                    break
            total = all_reduce(torch.tensor([len(self._val_cache)], device=self.device), self.env)
            if not int(total.item()):
                raise UserError("the val split yielded no batches: check data.val shards")
        return self._val_cache

    def evaluate(self) -> EvalResult:
        """Per-task val loss with real, blanked and swapped media; callbacks add to the record (on_eval)."""
        self.refresh_replica()
        result = evaluate_ranks(self.model, self.val_batches(), self.device, self.env, pad=self.pad_batch,
                                autocast=self.autocast, evaluates=self.train_module.evaluates)
        self.log.scalars(self.step, result.scalars())
        parts = [f"{t} {v:.3f}" for t, v in result.loss.items()]
        reads = [f"{t} {v:+.3f}" for t, v in result.mismatch_gap.items()]
        blanked = [f"{t} {v:+.3f}" for t, v in result.reliance_gap.items()]
        self.log.info(f"eval @ {self.step}: loss {', '.join(parts)} | mismatch gap {', '.join(reads) or '-'}"
                      f" | blanked gap (out of distribution) {', '.join(blanked)}")
        record = {"step": self.step, **result.to_dict()}
        self.callbacks.emit("on_eval", self, record)
        self.state.evals.append(record)
        return result

    def refresh_replica(self) -> None:
        """dist.pp > 1: load the evaluation replica (`model`) with every stage's weights, if they moved;
        before evaluation, diagnostics and captioning. Every rank calls it at the same points."""
        self.train_module.refresh()

    def pad_batch(self) -> PackedBatch:
        """A batch that adds nothing to any sum: pads a rank's val batches to the others' count."""
        return self.objective.pad_batch()

    def is_log_step(self, stats: StepStats) -> bool:
        """Whether this step's scalars go to TensorBoard (every `train.log_every` steps, and skips)."""
        return self.step % self.cfg.train.log_every == 0 or stats.skipped

    def _log_step(self, s: StepStats) -> None:
        """metrics.jsonl and the progress line every step; TensorBoard's train/* on log steps."""
        weights, lr = self.balancer.weights(), self.scheduler.get_last_lr()[0]
        parts = self.grad_parts.pop()  # grad_norm/*, update_ratio/*: log steps only
        eta_s = self.eta.remaining(self.step, time.monotonic() - self._t_launch)  # once: line and record
        self.log.progress(self.step, self._progress_line(s, weights, eta_s))
        self.log.record({"step": self.step, "loss": s.loss, "task_loss": s.task_loss, "task_acc": s.task_acc,
                         "weights": weights, **s.terms, "grad_norm": s.grad_norm,
                         "lr": lr, "skipped": s.skipped, "tokens": s.tokens, "step_s": s.step_s,
                         "wall_s": time.monotonic() - self._t_launch,
                         "eta_s": eta_s,
                         "wait_s": s.data_wait_s, "task_tokens": s.task_tokens,
                         **({"mix": self._mix.weights()} if self._mix is not None else {}), **s.figures,
                         **parts})
        if s.skipped:
            self.log.info(f"step {self.step}: non-finite loss or gradient, update skipped "
                          f"({self.state.consecutive_skips} in a row, {self.state.skipped_steps} in all)")
        if self.is_log_step(s):
            self.log.scalars(self.step, {**self._train_scalars(s, weights, lr), **parts})

    def _log_callback_scalars(self, s: StepStats) -> None:
        """The callbacks' TensorBoard scalars of a log step (`on_log`), after every on_step_end."""
        scalars: dict[str, float] = {}
        self.callbacks.emit("on_log", self, s, scalars)
        if scalars:
            self.log.scalars(self.step, scalars)

    def _progress_line(self, s: StepStats, weights: dict[str, float], eta_s: float | None) -> str:
        short = {"text": "txt", "image_text": "img", "video_text": "vid"}
        losses = " ".join(f"{short[t]} {v:.2f}" for t, v in s.task_loss.items())
        w_info = "" if not self.balancer.signals else (  # static: nothing moves them
            " | w " + " ".join(f"{short[t]} {weights[t]:.2f}" for t in TASK_NAMES))
        if self._mix is not None:
            w_info += " | mix " + " ".join(f"{k} {v:.2f}" for k, v in self._mix.weights().items())
        unit = "tok/s/dev" if self.env.world_size > 1 else "tok/s"
        tok_s = s.tokens_per_s_per_device(self.env.world_size)
        eta = format_eta(eta_s)
        line = f"{losses}{w_info} | {tok_s:,.0f} {unit} | wait {s.wait_fraction():.0%}"
        return f"{line} | {eta}" if eta else line

    def _train_scalars(self, s: StepStats, weights: dict[str, float], lr: float) -> dict[str, float]:
        scalars = {f"train/loss_{t}": v for t, v in s.task_loss.items()}
        scalars.update({f"train/acc_{t}": v for t, v in s.task_acc.items()})
        scalars.update({f"train/weight_{t}": w for t, w in weights.items()})
        scalars.update(self.balancer.scalars())
        scalars.update({f"train/loss_{name}": v for name, v in s.terms.items() if v is not None})
        scalars.update({f"train/{name}_{k}": v for name, fig in s.figures.items() for k, v in fig.items()})
        scalars.update({"train/loss": s.loss, "train/grad_norm": s.grad_norm, "train/lr": lr,
                        "train/skipped_steps": self.state.skipped_steps})
        return scalars

    def summary(self, ckpt: Path) -> dict:
        """The run's end: counters, first and last eval, weights; callbacks add theirs (on_train_end)."""
        st = self.state
        return {
            "run_dir": str(self.run_dir), "checkpoint": str(ckpt), "steps": st.step,
            "tokens_seen": st.tokens_seen, "skipped_steps": st.skipped_steps,
            "world_size": self.env.world_size, "start": st.evals[0], "end": st.evals[-1],
            "balancer": self.cfg.loss.balancer.kind, "weights": self.balancer.weights(),
        }


def _due(step: int, every: int) -> bool:
    return bool(every) and step % every == 0


def _set_threads(threads: int, env: DistEnv) -> None:
    """train.threads per process; with several ranks on a node, capped at the node's cores / ranks."""
    if not threads:
        return
    if env.local_world_size > 1:
        threads = min(threads, max(1, (os.cpu_count() or 1) // env.local_world_size))
    torch.set_num_threads(threads)


def _fill_vocab(cfg: RunConfig, vocab_size: int) -> None:
    dec = cfg.model.decoder
    if dec.vocab_size is None:
        dec.vocab_size = vocab_size
    elif dec.vocab_size < vocab_size:
        raise UserError(
            f"model.decoder.vocab_size: {dec.vocab_size} is smaller than the tokenizer's {vocab_size}"
        )
