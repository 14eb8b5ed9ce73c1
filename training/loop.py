"""The training loop: a Trainer owns a run's state (model, optimizer, generators, step, best loss) and takes its
steps, evaluates, saves and logs, until the run ends or a signal stops it at a step boundary."""

from __future__ import annotations

import gc
import math
import os
import signal
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from configs.userinput import shown
from data import CharTokenizer, get_batch
from model import GPT

from . import collector, distributed, paired_step
from .average import WeightAverage
from .checkpoints import (
    DAMAGED,
    EVAL_PENDING,
    IncompleteSave,
    checkpoint_payload,
    damaged,
    rank_rng_state,
    restore_rng,
    restore_training_state,
    save_checkpoint,
    set_rank_rng_state,
)
from .config import RunConfig
from .devices import autocast_context
from .distributed import EVALUATION, derived_seed
from .errors import Diverged, SaveError, agreeing
from .evaluation import estimate_loss
from .launch import Launch
from .logger import Logger, Throughput, sample_text
from .optim import compiler_loaded, lr_at
from .signals import Stopped, StopSignals

# Under torchrun, how often (in micro-batches) the processes of a step of many ask together whether to stop.
MICRO_STOP_EVERY = 16

# float16's gradient scaler halves its scale at each step whose gradients overflow (from 2**16): below this, they
# overflow unscaled, which no scale mends (see Trainer.train_step).
MIN_FLOAT16_SCALE = 1.0


# The attention picture logged at each evaluation shows this many characters at most. A 6-layer, 6-head model's picture
# of 256 characters is 9,571 x 9,573 pixels and took 10 s per evaluation to draw and encode (2-core EPYC; 8 s on an
# H100 machine's CPU), 21 times in configs/shakespeare_char.yaml; of 64 characters, 3,043 x 3,045 pixels, 0.4-1.1 s.
ATTENTION_LOG_CHARS = 64


class Trainer:
    """One process's part of a training run, from its current step to train.max_iters.

    model is the plain GPT (what checkpoints hold); fwd is what the steps call: the model, compiled and/or wrapped
    in DDP. The run's random state lives in gen (batches) and torch's global generator (dropout).
    """

    def __init__(self, cfg: RunConfig, model: GPT, optimizer: torch.optim.Optimizer, splits: dict[str, torch.Tensor],
                 *, device: torch.device, dtype: torch.dtype, gen: torch.Generator, fwd: nn.Module | None = None,
                 scaler: torch.amp.GradScaler | None = None, launch: Launch | None = None, step: int = 0,
                 best_val: float = math.inf, saved_step: int | None = None) -> None:
        self.cfg, self.tc = cfg, cfg.train
        self.model, self.fwd = model, fwd if fwd is not None else model
        # Listed once: walking the module tree for the gradient clipping of every step costs about 0.2 ms (tiny.yaml's
        # 41 parameters), 2% of its step. The Parameter objects stay the same for the whole run.
        self.parameters = list(model.parameters())
        self.optimizer, self.scaler = optimizer, scaler
        # train.ema_decay: the weights' moving average, which evaluations, best.pt and sampling use
        self.average = WeightAverage(model, cfg.train.ema_decay) if cfg.train.ema_decay > 0 else None
        self.splits, self.device, self.dtype, self.gen = splits, device, dtype, gen
        self.launch = launch or Launch()
        # Set by the runner when the whole step runs compiled (training.compiled_step.CompiledStep); engine names the
        # path taken, which a checkpoint records so that a resumed `auto` run takes the same one.
        self.compiled_step: Callable[[torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]] | None
        self.compiled_step, self.engine = None, "eager"
        self.settled: dict[str, str] = {}  # (runner.settled_setup), for a resume to tell whether it goes on exactly
        self.step, self.best_val = step, best_val
        self.saved_step = saved_step  # the step out_dir/ckpt.pt holds, None before this run has one
        self.evaluated_step: int | None = None  # the last step whose evaluation ran to its end
        self.eval_pending = False  # resumed where a stop cut the evaluation of the step short: it comes first
        self.reseeded = False  # resumed with another number of processes: batches drawn afresh (see restore_rng)
        self.after_first_save: Callable[[], None] | None = None  # rank 0: called once, after the first save
        # An --overwrite that moved an old run aside (in every process): until this run's first checkpoint, a stop
        # saves nothing, so that the old run comes back rather than give way to a few steps of this one.
        self.replacing = False
        self.data_fingerprint: str | None = None  # the corpus's (Corpus.fingerprint), saved for resumes to check
        self.out_dir = Path(cfg.out_dir) if cfg.out_dir is not None else None
        self.eval_seed = cfg.seed + 1 if self.launch.main else derived_seed(cfg.seed, EVALUATION, self.launch.rank)
        self.stop = StopSignals()
        self.agreed_stop = False  # under torchrun: whether the processes agreed, after the last step, to stop
        # under torchrun, the process that started this one: should it go (kill -9), torchrun no longer passes on
        # Ctrl-C, and the workers trained on to the end, each in a session of its own, holding out_dir's lock
        self.launcher = os.getppid() if self.launch.torchrun else None
        self.throughput = Throughput()
        # What throughput is reported against: tokens per step over all processes, the model's FLOPs per token, and
        # the matmul ceiling in FLOP/s summed over the processes (measured by the runner; MFU is 0 until then).
        world = self.launch.world_size
        self.tokens_per_step = self.tc.batch_size * cfg.model.block_size * self.tc.grad_accum_steps * world
        self.flops_per_token = model.flops_per_token()
        self.ceiling = math.inf
        self.last_losses: dict[str, float] = {}
        self.val_history: list[tuple[float, float]] = []  # (seconds since the run began, validation loss)
        self.eval_seconds = 0.0
        self.started = time.perf_counter()
        # Filled by attach() for a run that logs and saves: the logger, vocabulary, and the text the attention
        # images show.
        self.log: Logger | None = None
        self.tokenizer: CharTokenizer | None = None
        self.attention_prompt: list[int] = []

    def attach(self, log: Logger, tokenizer: CharTokenizer, started: float) -> None:
        """Give the run its logger and vocabulary (what evaluating and saving need) and the moment it began."""
        self.log, self.tokenizer, self.started = log, tokenizer, started
        # A fixed stretch of validation text whose attention maps TensorBoard shows at every evaluation: at most
        # ATTENTION_LOG_CHARS characters, since the picture grows as the square of its length.
        self.attention_prompt = self.splits["val"][: min(self.cfg.model.block_size, ATTENTION_LOG_CHARS)].tolist()

    def restore(self, payload: dict, path: Path) -> None:
        """Continue the run a checkpoint holds: weights, optimizer and scaler, step, best loss, and this process's
        random state (or fresh streams, when it was saved by another number of processes)."""
        self.step, self.best_val = restore_training_state(payload, self.model, self.optimizer, self.scaler, path)
        if self.average is not None:  # the saved average is the checkpoint's "model" (its trained weights are apart)
            try:
                self.average.load_state_dict(payload["model"])
            except DAMAGED as e:
                raise damaged(path, e) from None
        self.saved_step = self.step
        self.eval_pending = bool(payload.get(EVAL_PENDING, False))
        self.reseeded = not restore_rng(payload, self.gen, self.launch, self.device, self.cfg.seed, path)

    # ------------------------------------------------------------------------------------------- one step

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """One optimizer step over grad_accum_steps micro-batches: (mean loss, gradient norm, learning rate); None
        when a stop came between two of its micro-batches, and the step was not taken."""
        tc, block_size = self.tc, self.cfg.model.block_size
        lr = lr_at(self.step, tc)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.compiled_step is not None:
            return self.compiled_train_step(lr)
        loss_sum = torch.zeros((), device=self.device)
        # A step of many micro-batches (train.grad_accum_steps=10**18 never ended) stops between two of them when asked:
        # the step is not taken, and the random state goes back to where it began, so the run resumes exactly.
        start = rank_rng_state(self.gen, self.device) if tc.grad_accum_steps > 1 else None
        for micro in range(tc.grad_accum_steps):
            if micro and self.stop_between_micro_batches(micro):
                self.optimizer.zero_grad(set_to_none=True)
                set_rank_rng_state(start, self.gen, self.device)
                return None
            x, y = get_batch(self.splits["train"], block_size, tc.batch_size, self.gen, self.device)
            # Under DDP, backward all-reduces the gradients only on the last micro-batch of a step: the earlier
            # ones accumulate in each process, and the last all-reduce carries their sum.
            with distributed.local_only(self.fwd, micro < tc.grad_accum_steps - 1):
                with autocast_context(self.device, self.dtype):
                    _, loss = self.fwd(x, y)
                loss = loss / tc.grad_accum_steps
                loss_sum += loss.detach()
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        max_norm = tc.grad_clip if tc.grad_clip > 0 else math.inf
        # Under DDP the gradients are already averaged over the processes: the same norm in every one.
        grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters, max_norm)
        if self.launch.torchrun:  # the mean loss (so all judge divergence alike) and whether to stop after this step
            if self.launcher is not None and os.getppid() != self.launcher:  # torchrun has gone: stop as if told to
                self.stop.request(signal.SIGTERM)
            loss_sum, self.agreed_stop = distributed.step_consensus(loss_sum, self.stop.signal is not None)
        # Checked before the update, so a non-finite step never reaches the weights. With float16 the gradient
        # scaler skips a step whose gradients overflow and lowers its scale; a loss that overflows is no matter of
        # scale (the forward pass is not scaled), and neither are gradients that overflow at a scale below 1: the
        # scaler would skip every step to the end, and the run end with NaN losses and its weights where they were.
        if not math.isfinite(float(loss_sum)) or (self.scaler is None and not math.isfinite(float(grad_norm))):
            raise Diverged(self.step + 1, float(loss_sum), float(grad_norm), self.saved_step,
                           dtype=self.dtype_name)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scaler.get_scale() < MIN_FLOAT16_SCALE:
                raise Diverged(self.step + 1, float(loss_sum), float(grad_norm), self.saved_step,
                               dtype=self.dtype_name)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.fold_into_average()
        return loss_sum, grad_norm, lr

    @property
    def dtype_name(self) -> str:
        """What train.dtype resolved to, as the config spells it: "float32", "bfloat16" or "float16"."""
        return str(self.dtype).removeprefix("torch.")

    def fold_into_average(self) -> None:
        if self.average is not None:
            self.average.update(self.step)

    def micro_batches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's micro-batches stacked, (grad_accum_steps, batch_size, T) each: drawn one by one, as the eager
        step draws them, so both engines train on the same batches."""
        pairs = [get_batch(self.splits["train"], self.cfg.model.block_size, self.tc.batch_size, self.gen, self.device)
                 for _ in range(self.tc.grad_accum_steps)]
        stack = (lambda ts: ts[0].unsqueeze(0)) if len(pairs) == 1 else torch.stack  # one: a view, not a copy
        return stack([x for x, _ in pairs]), stack([y for _, y in pairs])

    def compiled_train_step(self, lr: float) -> tuple[torch.Tensor, torch.Tensor, float]:
        """train_step through the compiled engine: forward, backward, clipping and AdamW in one call, which updates
        nothing when the loss or gradient norm is not finite."""
        # A step in halves (training/paired_step.py) has the cores to itself: drawing the batch and folding the weights
        # into their average on one thread too, as a team of two left its second thread spinning into the next halves.
        with paired_step.one_thread() if getattr(self.compiled_step, "parts", 1) > 1 else nullcontext():
            xs, ys = self.micro_batches()
            loss_sum, grad_norm = self.compiled_step(xs, ys, lr)
            if not (math.isfinite(float(loss_sum)) and math.isfinite(float(grad_norm))):  # 1 us; torch.isfinite's 27
                raise Diverged(self.step + 1, float(loss_sum), float(grad_norm), self.saved_step, compiled=True,
                               dtype=self.dtype_name)
            self.step += 1
            self.fold_into_average()
        return loss_sum, grad_norm, lr

    # ------------------------------------------------------------------------------------ the whole run

    def stopping(self) -> bool:
        # Under torchrun only the agreement counts: a process that saw a signal after it must not stop a step before
        # the others, who would then wait for it in vain.
        return self.agreed_stop if self.launch.torchrun else self.stop.signal is not None

    def stop_between_micro_batches(self, micro: int) -> bool:
        """Whether a stop ends the step before its micro-batch micro. Under torchrun the processes ask together (an
        all-reduce each time), every MICRO_STOP_EVERY micro-batches so that a step of a few pays nothing."""
        if self.launch.torchrun:
            return micro % MICRO_STOP_EVERY == 0 and self.stop_asked()
        return self.stop.signal is not None

    def stop_asked(self) -> bool:
        """Whether to stop now, between two batches of an evaluation (collective under torchrun: every process asks
        as often, after the same batches, so all of them stop at the same one)."""
        if self.launch.torchrun:
            self.agreed_stop = distributed.any_process(self.stop.signal is not None, self.device)
        return self.stopping()

    def fit(self) -> dict[str, float]:
        """Train to train.max_iters, evaluating and saving every eval_interval steps; the final losses and timings.
        Raises Stopped after saving when a signal (or a closed output) asked the run to stop."""
        tc = self.tc
        self.model.train()
        collector.resume()  # paused by train.py while the run started
        # The handlers stay until the end of the run, so a signal while the logs are closed cannot cut that short.
        with self.stop:
            try:
                if self.eval_pending and not self.stopping():  # cut short by the stop this run resumes from
                    self.eval_pending = False
                    self.evaluate_and_save()
                self.throughput.resume()
                while self.step < tc.max_iters and not self.stopping():
                    taken = self.train_step()
                    if taken is None:  # stopped between two micro-batches
                        break
                    loss, grad_norm, lr = taken
                    self.throughput.count()
                    if self.step % tc.log_interval == 0 or self.step == tc.max_iters:
                        self.log_step(loss, grad_norm, lr)
                    if self.step % tc.eval_interval == 0 or self.step == tc.max_iters:
                        self.throughput.pause()  # evaluation time is not training throughput
                        self.evaluate_and_save()
                    self.throughput.resume()
                self.throughput.pause()
                # A stop that comes once the last step is evaluated and saved (while its logged sample is drawn, say)
                # ends nothing: the run is done, and a resume of it would be refused
                done = self.step >= tc.max_iters and self.evaluated_step == self.step == self.saved_step
                if self.stopping() and not done:
                    keep = not (self.replacing and self.saved_step is None)
                    if keep and self.saved_step != self.step:
                        self.save(improved=False)
                    # a process that saw no signal itself stops because another did: as if sent SIGTERM
                    raise Stopped(self.stop.signal or signal.SIGTERM, self.step, saved=keep)
                if not self.last_losses:  # nothing to train (resumed at the end, or max_iters=0): still report
                    self.evaluate_and_save()
            finally:
                self.log.close()
                if self.launch.torchrun:
                    # DDP goes before the process group does: left to the interpreter's exit, it sometimes aborts the
                    # process ("terminate called without an active exception"; seen with torch 2.13 and gloo).
                    self.fwd = None
                    gc.collect()
        return {**self.last_losses, "best_val": self.best_val, "seconds": time.perf_counter() - self.started,
                "eval_seconds": self.eval_seconds, "val_history": self.val_history, "step": self.step}

    def log_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        """Loss, learning rate, gradient norm, and tokens/s and MFU over the training time since the last log."""
        steps, seconds = self.throughput.take()
        tok_s = self.tokens_per_step * steps / max(seconds, 1e-9)
        loss_value = float(loss)
        mfu = self.flops_per_token * tok_s / self.ceiling
        log = self.log
        log.scalars(self.step, {"loss/train_step": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                                "tokens_per_sec": tok_s, "mfu": mfu})
        log.step(self.step, steps, {"loss": f"{loss_value:.4f}", "lr": f"{lr:.2e}", "tok/s": f"{tok_s:,.0f}",
                                    "mfu": f"{mfu:.1%}"})
        if not log.progress:
            log.info(f"step {self.step}/{self.tc.max_iters}: loss {loss_value:.4f}, lr {lr:.2e}, "
                     f"{tok_s:,.0f} tokens/s, MFU {mfu:.1%}")

    # ------------------------------------------------------------------------------ evaluating and saving

    def evaluate(self) -> dict[str, float] | None:
        """Train and validation loss, averaged over the processes under torchrun; None if a stop cut it short."""
        tc = self.tc
        losses = estimate_loss(self.model, self.splits, self.cfg.model.block_size, tc.batch_size, tc.eval_iters,
                               self.eval_seed, self.device, self.dtype, stop=self.stop_asked)
        if losses is None:
            return None
        if self.launch.torchrun:  # each process evaluated windows of its own; the run's loss is the mean over them
            losses = dict(zip(losses, distributed.mean(list(losses.values()), self.device), strict=True))
        return losses

    def evaluate_and_save(self) -> None:
        """Evaluate (the weights' average, with train.ema_decay), log the losses, a sample and the attention, save."""
        t0 = time.perf_counter()
        with self.average.in_model() if self.average is not None else nullcontext():
            losses = self.evaluate()
            if losses is None:  # stopped midway: no result to log; the loop saves the state and stops
                return
            improved = losses["val"] < self.best_val
            self.best_val = min(self.best_val, losses["val"])
            log, step = self.log, self.step
            log.scalars(step, {"loss/train": losses["train"], "loss/val": losses["val"],
                               "hparam/best_val_loss": self.best_val})
            log.info(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
                     + (" (best)" if improved else ""))
            if log.writer is not None:  # rank 0 alone, on the model itself: nothing here may wait for the others
                # Eagerly, where the blocks run compiled (engine "blocks": DDP, float16): the sample's cache and the
                # attention's weights call a block with other arguments at every layer and position, each a new
                # compile, until dynamo gives up (2 processes, 30 steps: 76 s against 21.5 s without the sample).
                # Setting the stance imports the compiler: not where none is loaded, as nothing can be compiled then.
                with torch.compiler.set_stance("force_eager") if compiler_loaded() else nullcontext():
                    if self.tc.sample_chars:
                        sample = sample_text(self.model, self.tokenizer, self.tc.sample_chars, self.cfg.seed,
                                             self.device, stop=lambda: self.stop.signal is not None)
                        if sample is not None:  # else a signal cut it short: the loop saves and stops
                            log.text(step, "sample", "```\n" + sample + "\n```")
                    log.attention(step, self.model, self.attention_prompt, self.tokenizer,
                                  background=self.device.type == "cuda")
        self.evaluated_step = self.step
        self.save(improved)
        self.last_losses.update(losses)
        self.val_history.append((time.perf_counter() - self.started, losses["val"]))
        self.eval_seconds += time.perf_counter() - t0

    def save_failure(self, e: OSError, written: list[Path]) -> str:
        """The line for a save that failed midway: what out_dir holds now (written: the files this save replaced)."""
        where, reason = shown(str(self.out_dir)), e.strerror or e
        advice = "Free some space or choose another out_dir"
        if self.replacing and self.saved_step is None:  # the runner puts the old run back over what was written
            return (f"cannot write a checkpoint into '{where}' ({reason}); nothing of this --overwrite run is kept, "
                    f"and the run it was replacing is back. {advice}")
        best = (self.out_dir / "best.pt").exists()
        if written:  # ckpt.pt is this step's; best.pt could not follow
            kept = "best.pt still holds an earlier best" if best else "there is no best.pt"
            return (f"cannot write best.pt into '{where}' ({reason}); ckpt.pt there holds step {self.step}, the best, "
                    f"and {kept} (--resume copies ckpt.pt into it). {advice}")
        if self.saved_step is None:
            return f"cannot write a checkpoint into '{where}' ({reason}); this run has saved none yet. {advice}"
        intact = f"ckpt.pt (step {self.saved_step})" + (" and best.pt there are" if best else " there is")
        return f"cannot write a checkpoint into '{where}' ({reason}); {intact} intact. {advice}"

    def save(self, improved: bool) -> None:
        """ckpt.pt (and best.pt when improved) from rank 0; should that fail, every process stops."""
        launch = self.launch
        ranks = distributed.all_gather(rank_rng_state(self.gen, self.device)) if launch.torchrun else None
        with agreeing(launch):
            if not launch.main:
                return
            state = checkpoint_payload(self.model, self.optimizer, self.scaler, self.tokenizer, self.cfg, self.step,
                                       self.best_val, self.gen, ranks)
            if self.average is not None:  # "model" is what is evaluated and sampled; the trained weights go apart
                state["training_weights"], state["model"] = state["model"], self.average.state_dict()
            # is_best: for a resume to put it into a best.pt that failed to follow it; EVAL_PENDING: a stop cut this
            # step's due evaluation short, which a resume runs first (it was lost; at the last step, unfinishable)
            due = self.step > 0 and (self.step % self.tc.eval_interval == 0 or self.step == self.tc.max_iters)
            state.update({"data_fingerprint": self.data_fingerprint, "engine": self.engine, "is_best": improved,
                          "settled": self.settled, EVAL_PENDING: due and self.evaluated_step != self.step})
            # The curves up to this step reach the disk before the checkpoint, so a run killed after saving and
            # resumed shows no gap in TensorBoard; the attention picture drawn in the background may come later.
            self.log.flush(pictures=False)
            try:
                save_checkpoint(state, self.out_dir / "ckpt.pt", *([self.out_dir / "best.pt"] if improved else []))
            except OSError as e:
                raise SaveError(self.save_failure(e, e.written if isinstance(e, IncompleteSave) else [])) from None
        self.saved_step = self.step  # in every process: they agreed that rank 0 saved
        if self.after_first_save is not None:
            self.after_first_save()
            self.after_first_save = None
