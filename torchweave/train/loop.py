"""The training loop every rank runs: build, resume, step, log, checkpoint, summarize."""

from __future__ import annotations

import math
import os
import random
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.markup import escape

from torchweave.errors import Problem, TorchweaveError
from torchweave.parallel import parallelize
from torchweave.runtime.executor import StepConfig
from torchweave.runtime.launch import RankContext
from torchweave.train.build import build_model, lr_multiplier, optimizer_factory
from torchweave.train.checkpoint import CheckpointError, latest, save
from torchweave.train.config import TrainConfig
from torchweave.train.data import Sampler, build_dataset
from torchweave.train.export import export_safetensors
from torchweave.train.logs import MetricsLog, ProgressView
from torchweave.train.restore import load


class TrainingError(TorchweaveError):
    """A run that cannot go on (too many bad steps in a row, say)."""


def peak_rss_mib() -> float:
    """This process's peak resident set, MiB: ``VmHWM`` of ``/proc/self/status`` where there
    is one, the process image's own. (``ru_maxrss`` keeps, across ``exec``, the peak of the
    process that started this one: a rank spawned by a launcher at 1.2 GB reports 1.2 GB.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    scale = 1024 * 1024 if os.uname().sysname == "Darwin" else 1024  # bytes there, kB here
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale

@dataclass
class RunResult:
    """What a finished run reports (rank 0's view, with every rank's memory)."""

    run_dir: str
    plan: str
    plan_reason: str
    start_step: int
    steps: int
    losses: dict[int, float] = field(default_factory=dict)
    """Loss of every step this process ran (skipped steps included, as NaN or inf)."""
    skipped: int = 0
    tokens_per_s: float = 0.0
    step_time_s: float = 0.0
    peak_rss_mib: list[float] = field(default_factory=list)
    state_mib: list[float] = field(default_factory=list)
    """Per rank: parameters, gradients and optimizer state held, in MiB."""
    loop_s: float = 0.0
    """Wall time of the training loop (steps, logging, periodic checkpoints), this rank."""
    compute_s: float = 0.0
    """Of that, the time inside the steps themselves (forward, backward, norm, update)."""
    checkpoint: str | None = None
    weights: str | None = None
    """Merged single-device weights (safetensors), written at the end."""
    failed_saves: int = 0
    code_dir: str = ""
    metrics: str = ""
    tensorboard: str | None = None


class Trainer:
    """One rank's training run under ``config`` (every rank builds and runs one)."""

    def __init__(self, config: TrainConfig, ctx: RankContext, *, plan: str | None = None,
                 plan_reason: str = "", console: Console | None = None) -> None:
        self.cfg, self.ctx = config, ctx
        self.rank = ctx.rank
        self.run_dir = Path(config.run_dir).resolve()
        self.console = console or Console(stderr=False, markup=False)
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        self.dataset = build_dataset(config.data, config.seed)
        self.sampler = Sampler(self.dataset, config.parallel.global_batch, config.seed)
        vocab = getattr(self.dataset, "vocab_size", None)
        self.model = build_model(config.model, vocab_size=vocab, seq_len=config.data.seq_len)
        example = self._example()
        self.plan = plan or config.parallel.plan
        self.plan_reason = plan_reason
        self.code_dir = self.run_dir / "code"
        step_cfg = StepConfig(grad_accum=config.parallel.grad_accum, clip_grad_norm=None,
                              precision=config.parallel.precision,
                              p2p_tags=config.parallel.p2p_tags,
                              bucket_mb=config.parallel.bucket_mb)
        self.module = parallelize(self.model, example, plan=self.plan, groups=ctx.groups,
                                  optimizer=optimizer_factory(config.optim), config=step_cfg,
                                  code_dir=str(self.code_dir))
        self.lr = lr_multiplier(config.schedule, config.steps)
        self.tokens_per_step = int(example[0].numel()) if example[0].dtype in (
            torch.int64, torch.int32) else int(example[0].shape[0])
        self.step = 0
        self.skipped = 0
        self.bad_in_row = 0
        self.resumed_from: str | None = None
        self._log: MetricsLog | None = None

    def _example(self) -> tuple[torch.Tensor, ...]:
        """A global batch of the right shapes (the first one), without moving the sampler."""
        probe = Sampler(self.dataset, self.cfg.parallel.global_batch, self.cfg.seed)
        return probe.next_batch()

    # ------------------------------------------------------------ checkpoints
    def _extra(self) -> dict[str, Any]:
        return {"consumed": self.sampler.consumed, "skipped": self.skipped,
                "bad_in_row": self.bad_in_row, "py_rng": list(random.getstate()[1]),
                "py_rng_pos": random.getstate()[2], "rng": torch.get_rng_state()}

    def resume(self) -> None:
        """Load the newest complete checkpoint; one that fails to load stops the run."""
        found = latest(self.cfg.checkpoint_dir) if self.cfg.resume else None
        if found is None:
            return
        restored = load(found, self.module)
        extra = restored.extra
        self.step = restored.step
        self.sampler.consumed = int(extra.get("consumed", restored.step * self.sampler.global_batch))
        self.skipped = int(extra.get("skipped", 0))
        self.bad_in_row = int(extra.get("bad_in_row", 0))
        if restored.same_layout and "rng" in extra:
            torch.set_rng_state(extra["rng"])
            random.setstate((3, tuple(extra["py_rng"]), extra["py_rng_pos"]))
        else:  # another plan or world size: each rank's stream starts afresh, seeded by the step
            torch.manual_seed(self.cfg.seed * 7919 + self.step * 131 + self.rank)
            random.seed(self.cfg.seed + self.step + self.rank)
        self.resumed_from = str(found)

    def _save(self, log: MetricsLog | None) -> tuple[str | None, bool]:
        try:
            path = save(self.module, None, self.step, self._extra(), self.cfg.checkpoint_dir,
                        keep=self.cfg.checkpoint.keep, plan=self.plan)
        except CheckpointError as e:
            if log is not None:
                log.event("checkpoint_failed", step=self.step, error=str(e))
                self.console.print(f"[yellow]checkpoint at step {self.step} failed; training "
                                   f"goes on, the last good checkpoint is kept:[/]\n{escape(str(e))}",
                                   markup=True)
            return None, False
        if log is not None:
            log.event("checkpoint", step=self.step, path=str(path))
        return str(path), True

    # ------------------------------------------------------------ the loop
    def run(self) -> RunResult:
        cfg = self.cfg
        self.resume()
        start = self.step
        log = view = None
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            log = MetricsLog(self.run_dir, tensorboard=cfg.tensorboard, tb_every=cfg.log_every)
            log.event("resume" if self.resumed_from else "start", step=start, plan=self.plan,
                      world_size=self.ctx.world_size, checkpoint=self.resumed_from)
            view = ProgressView(self.console, cfg.steps, start, enabled=cfg.progress,
                                log_every=cfg.log_every)
        (self.run_dir / f"rank{self.rank}.pid").write_text(str(os.getpid()))
        result = RunResult(run_dir=str(self.run_dir), plan=self.plan, plan_reason=self.plan_reason,
                           start_step=start, steps=cfg.steps, code_dir=str(self.code_dir),
                           metrics=str(log.path) if log else "",
                           tensorboard=str(log.tb_dir) if log and log.tb_dir else None)
        times: list[float] = []
        t_loop = time.perf_counter()
        try:
            while self.step < cfg.steps:
                self.step += 1
                batch = self.sampler.next_batch()
                t0 = time.perf_counter()
                loss, norm, ok = self._one_step(batch)
                dt = time.perf_counter() - t0
                times.append(dt)
                result.losses[self.step] = loss
                note = ""
                if not ok:
                    note = (f"step {self.step}: loss {loss} / grad norm {norm}: not finite; "
                            f"skipped ({self.bad_in_row} in a row)")
                    if self.bad_in_row >= cfg.max_bad_steps:
                        raise TrainingError(Problem(
                            obj=f"step {self.step}", value=f"loss {loss}, grad norm {norm}",
                            rule=f"at most {cfg.max_bad_steps - 1} non-finite steps in a row "
                                 f"(max_bad_steps={cfg.max_bad_steps})",
                            fix="lower optim.lr, enable clipping, check the data; or resume "
                                "from the last checkpoint"))
                if log is not None:
                    recent = times[-10:]
                    tps = self.tokens_per_step * len(recent) / sum(recent)
                    log.step(self.step, {"loss": loss, "lr": cfg.optim.lr * self.lr(self.step),
                                         "grad_norm": norm, "step_time_s": dt,
                                         "tokens_per_s": tps, "skipped": self.skipped})
                    eta = (cfg.steps - self.step) * sum(recent) / len(recent)
                    view.update(self.step, cfg.steps, loss, tps, eta, note)
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 \
                        and self.step < cfg.steps:
                    path, good = self._save(log)
                    result.checkpoint = path or result.checkpoint
                    result.failed_saves += not good
            result.loop_s = time.perf_counter() - t_loop
            result.compute_s = sum(times)
            path, good = self._save(log)
            result.checkpoint = path or result.checkpoint
            result.failed_saves += not good
        finally:
            if view is not None:
                view.close()
        self._log = log
        result.weights = self._export()
        result.skipped = self.skipped
        steady = times[1:] or times
        result.step_time_s = sorted(steady)[len(steady) // 2] if steady else 0.0
        result.tokens_per_s = self.tokens_per_step / result.step_time_s if steady else 0.0
        mem = [peak_rss_mib(), self.module.memory() / 2**20]
        gathered: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(gathered, mem)
        result.peak_rss_mib = [g[0] for g in gathered]
        result.state_mib = [g[1] for g in gathered]
        if log is not None:
            log.event("end", step=self.step, tokens_per_s=result.tokens_per_s,
                      skipped=self.skipped, checkpoint=result.checkpoint)
            log.close()
        return result

    def _export(self) -> str | None:
        """Gather every rank's pieces on rank 0 and write ``model.safetensors``; collective."""
        if not self.cfg.export:
            return None
        # each piece in storage of its own: a piece may be a view of a flat buffer (ZeRO's
        # shards, the gradient buckets' parameters), and pickling a view sends its whole
        # storage (the demo's rank 0 peaked at 2.7 GB here, for 0.8M parameters)
        pieces = {k: (box, t.detach().to("cpu", copy=True))
                  for k, (box, t) in self.module.state_pieces().items()}
        parts = {s.path: s.part for s in self.module.program.params if s.part is not None}
        everyone: list[Any] | None = [None] * self.ctx.world_size if self.rank == 0 else None
        dist.gather_object((pieces, parts), everyone, dst=0)
        if self.rank != 0:
            return None
        parts = {k: v for _, of in everyone for k, v in of.items()}  # a fused projection's parts
        everyone = [p for p, _ in everyone]
        held = {parts[k][0] if k in parts else k for p in everyone for k in p}
        groups: dict[int, list[str]] = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            groups.setdefault(id(t), []).append(name)
        shapes, aliases = {}, {}
        for names in groups.values():
            src = next((n for n in names if n in held), None)
            if src is None:
                continue  # a buffer no rank reads (not in the graph)
            shapes[src] = tuple(self.model.state_dict()[src].shape)
            if len(names) > 1:
                aliases[src] = [n for n in names if n != src]
        path = self.run_dir / "model.safetensors"
        try:
            export_safetensors(everyone, shapes, path, aliases=aliases, parts=parts)
        except Exception as e:  # noqa: BLE001 - a full disk, say (SafetensorError): keep the run
            Path(f"{path}.tmp").unlink(missing_ok=True)
            self._log_failure("export_failed", f"exporting {path} failed (the checkpoints hold "
                                               f"the weights): {type(e).__name__}: {e}")
            return None
        return str(path)

    def _log_failure(self, event: str, message: str) -> None:
        if self._log is not None:
            self._log.event(event, step=self.step, error=message)
        self.console.print(f"[yellow]{escape(message)}[/]", markup=True)

    def _one_step(self, batch: tuple[torch.Tensor, ...]) -> tuple[float, float, bool]:
        """Forward, backward, norm; the update only when both loss and norm are finite."""
        pending = self.module.backward_async(*batch)  # the loss summed (with the gradients,
        # or by a sum of its own that runs beside the norm's)
        clip = self.cfg.optim.clip_grad_norm
        norm = self.module.clip(clip) if clip is not None else self.module.grad_norm()
        loss = pending()
        ok = math.isfinite(loss) and math.isfinite(norm)
        if ok:
            factor = self.lr(self.step)
            for opt in self.module.optimizers():
                for group in opt.param_groups:
                    group["lr"] = self.cfg.optim.lr * factor
            self.module.optimizer_step()
            self.bad_in_row = 0
        else:
            self.module.zero_grads()
            self.skipped += 1
            self.bad_in_row += 1
        return loss, norm, ok


__all__ = ["RunResult", "Trainer", "TrainingError"]
