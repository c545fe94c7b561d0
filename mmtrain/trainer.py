"""The training loop: data -> model -> per-modality losses -> AdamW, with eval and checkpoints.

Single-process here; parallelism is applied from outside the model (see mmtrain/distributed).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data_pipelines.batch import TASK_NAMES, PackedBatch
from data_pipelines.loader import build_loader
from data_pipelines.tokenizer import load_tokenizer
from mmtrain.balance import build_balancer
from mmtrain.checkpoint import TOKENIZER_FILE, Checkpointer, load_state
from mmtrain.config import to_dict
from mmtrain.errors import UserError
from mmtrain.evaluate import EvalResult, evaluate
from mmtrain.logger import RunLogger
from mmtrain.objectives import task_losses, weighted_total, z_loss
from mmtrain.optim import build_optimizer, build_scheduler
from mmtrain.run_config import RunConfig
from mmtrain.run_dir import prepare_run_dir, write_resolved_config
from models.multimodal import MultimodalModel


@dataclass
class StepStats:
    loss: float
    task_loss: dict[str, float]
    grad_norm: float
    tokens: int
    data_wait_s: float
    step_s: float
    skipped: bool


class Trainer:
    def __init__(self, cfg: RunConfig, verbose: bool = True):
        self.cfg = cfg
        self.run_dir = prepare_run_dir(cfg.run_dir)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.device = _pick_device(cfg.train.device)
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        _fill_vocab(cfg, self.tokenizer.vocab_size)
        self.config_text = write_resolved_config(cfg, self.run_dir)
        _seed_everything(cfg.train.seed)
        self.model = MultimodalModel(cfg.model).to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.train.steps, cfg.optim)
        self.balancer = build_balancer(cfg.loss)
        self.train_loader = build_loader(cfg.data, self.tokenizer, "train")
        self.val_loader = build_loader(cfg.data, self.tokenizer, "val")
        self.checkpointer = Checkpointer(self.run_dir, cfg.train.keep_last)
        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0
        self.evals: list[dict] = []  # {"step": N, ...EvalResult.to_dict()}
        self._val_cache: list[PackedBatch] | None = None
        self.verbose = verbose
        self._consecutive_skips = 0
        self._wait_total = 0.0  # data-wait and step seconds since this process started
        self._time_total = 0.0
        self.resumed_from = self._resume()

    # ----- state -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "balancer": self.balancer.state_dict(),
            "data": self.train_loader.state_dict(),
            "rng": _rng_state(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "skipped_steps": self.skipped_steps,
            "evals": self.evals,
            "config": to_dict(self.cfg),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.balancer.load_state_dict(state["balancer"])
        self.train_loader.load_state_dict(state["data"])
        _set_rng_state(state["rng"])
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.skipped_steps = state["skipped_steps"]
        self.evals = list(state["evals"])

    def _resume(self) -> Path | None:
        latest = self.checkpointer.latest()
        if latest is None:
            return None
        try:
            self.load_state_dict(load_state(latest))
        except (KeyError, RuntimeError, ValueError) as e:
            raise UserError(f"{latest}: checkpoint does not match this config: {e}") from None
        return latest

    def save_checkpoint(self) -> Path:
        tok = Path(self.cfg.data.tokenizer)
        files = {TOKENIZER_FILE: tok} if tok.is_file() else {}
        return self.checkpointer.save(self.step, self.state_dict(), self.config_text, files)

    # ----- training ----------------------------------------------------------------------
    def fit(self) -> dict:
        cfg = self.cfg.train
        log = RunLogger(self.run_dir, cfg.steps, self.step, console=self.verbose)
        try:
            if self.resumed_from is not None:
                log.info(f"resumed from {self.resumed_from} at step {self.step}")
            if not self.evals:
                self._evaluate(log)
            train_iter = iter(self.train_loader)
            while self.step < cfg.steps:
                stats = self.train_step(train_iter)
                self._log_step(log, stats)
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                    self._evaluate(log)
                if cfg.ckpt_every and self.step % cfg.ckpt_every == 0 and self.step < cfg.steps:
                    self.save_checkpoint()
            if self.evals[-1]["step"] != self.step:
                self._evaluate(log)
            path = self.save_checkpoint()
            summary = self.summary(path)
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            return summary
        finally:
            log.close()

    def train_step(self, train_iter) -> StepStats:
        t_start = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        accum = self.cfg.train.grad_accum
        weights = self.balancer.weights()
        wait, tokens, total = 0.0, 0, 0.0
        task_sum = dict.fromkeys(TASK_NAMES, 0.0)
        task_count = dict.fromkeys(TASK_NAMES, 0)
        for _ in range(accum):
            t0 = time.perf_counter()
            batch = next(train_iter)
            wait += time.perf_counter() - t0
            batch = batch.to(self.device, non_blocking=True)
            tokens += batch.num_tokens()
            with self._autocast():
                out = self.model(**batch.model_inputs())
            losses = task_losses(out.logits_BSV, batch.labels_BS, batch.task_BS)
            loss = weighted_total(losses, weights)
            for aux in out.aux_losses.values():  # MoE balance and router z-loss, already weighted
                loss = loss + aux
            if self.cfg.loss.z_loss:
                loss = loss + self.cfg.loss.z_loss * z_loss(out.logits_BSV, batch.labels_BS)
            (loss / accum).backward()
            total += float(loss.detach()) / accum
            for t in TASK_NAMES:
                task_sum[t] += float(losses.loss_sum[t].detach())
                task_count[t] += int(losses.count[t])
        grad_norm = self._clip_grads()
        skipped = not (math.isfinite(total) and math.isfinite(grad_norm))
        if skipped:
            self._skip_step()
        else:
            self.optimizer.step()
            self.scheduler.step()
            self._after_optimizer_step()
        self.step += 1
        self.tokens_seen += tokens
        task_loss = {t: task_sum[t] / task_count[t] for t in TASK_NAMES if task_count[t]}
        self.balancer.observe(task_loss, self.step)
        return StepStats(total, task_loss, grad_norm, tokens, wait, time.perf_counter() - t_start, skipped)

    def _clip_grads(self) -> float:
        clip = self.cfg.optim.grad_clip or float("inf")
        params = [p for p in self.model.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, clip))

    def _skip_step(self) -> None:
        """A non-finite loss or gradient: drop the update, count it, stop if it keeps happening."""
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        self._consecutive_skips += 1
        if self._consecutive_skips >= self.cfg.train.max_skipped_steps:
            raise UserError(
                f"{self._consecutive_skips} consecutive non-finite steps at step {self.step}; "
                f"stopping (last checkpoint: {self.checkpointer.latest()})"
            )

    def _after_optimizer_step(self) -> None:
        self._consecutive_skips = 0
        self.model.update_moe_bias()  # auxiliary-loss-free balancing: load since the last step

    def _autocast(self):
        if self.device.type == "cuda" and self.cfg.train.dtype == "bfloat16":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ----- eval and logging --------------------------------------------------------------
    def val_batches(self) -> list[PackedBatch]:
        """The held-out batches, read once: every evaluation sees exactly the same tokens."""
        if self._val_cache is None:
            limit = self.cfg.train.eval_batches or None
            self._val_cache = []
            for batch in self.val_loader:
                self._val_cache.append(batch)
                if limit and len(self._val_cache) >= limit:
                    break
            if not self._val_cache:
                raise UserError("the val split yielded no batches: check data.val shards")
        return self._val_cache

    def _evaluate(self, log: RunLogger) -> EvalResult:
        result = evaluate(self.model, self.val_batches(), self.device, self._autocast)
        self.evals.append({"step": self.step, **result.to_dict()})
        log.scalars(self.step, result.scalars())
        parts = [f"{t} {v:.3f}" for t, v in result.loss.items()]
        gaps = [f"{t} {v:+.3f}" for t, v in result.reliance_gap.items()]
        log.info(f"eval @ {self.step}: loss {', '.join(parts)} | reliance gap {', '.join(gaps)}")
        return result

    def _log_step(self, log: RunLogger, s: StepStats) -> None:
        tok_s = s.tokens / max(s.step_s, 1e-9)
        wait = s.data_wait_s / max(s.step_s, 1e-9)
        self._wait_total += s.data_wait_s
        self._time_total += s.step_s
        short = {"text": "txt", "image_text": "img", "video_text": "vid"}
        losses = " ".join(f"{short[t]} {v:.2f}" for t, v in s.task_loss.items())
        log.progress(self.step, f"{losses} | {tok_s:,.0f} tok/s | wait {wait:.0%}")
        if self.step % self.cfg.train.log_every == 0 or s.skipped:
            scalars = {f"train/loss_{t}": v for t, v in s.task_loss.items()}
            scalars.update({f"train/weight_{t}": w for t, w in self.balancer.weights().items()})
            scalars.update({
                "train/loss": s.loss,
                "train/grad_norm": s.grad_norm,
                "train/lr": self.scheduler.get_last_lr()[0],
                "train/skipped_steps": self.skipped_steps,
                "perf/tokens_per_s": tok_s,
                "perf/data_wait_frac": wait,
            })
            log.scalars(self.step, scalars)

    def data_wait_fraction(self) -> float:
        return self._wait_total / max(self._time_total, 1e-9)

    def summary(self, ckpt: Path) -> dict:
        return {
            "run_dir": str(self.run_dir), "checkpoint": str(ckpt), "steps": self.step,
            "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps,
            "data_wait_fraction": self.data_wait_fraction(),
            "start": self.evals[0], "end": self.evals[-1],
        }


def _pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device: cuda requested but no CUDA device is available")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def _fill_vocab(cfg: RunConfig, vocab_size: int) -> None:
    dec = cfg.model.decoder
    if dec.vocab_size is None:
        dec.vocab_size = vocab_size
    elif dec.vocab_size < vocab_size:
        raise UserError(
            f"model.decoder.vocab_size: {dec.vocab_size} is smaller than the tokenizer's {vocab_size}"
        )


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
