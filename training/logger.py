"""What a run shows and records: progress on the terminal (a tqdm bar, or plain lines), TensorBoard scalars, text,
images and hyperparameters, and the training throughput they report."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import yaml

import lab.heatmap
from configs import flatten, to_dict
from configs.userinput import shown
from data import CharTokenizer
from lab.heatmap import attention_weights, characters_shown, render_attention_grid, too_large
from lab.pictures import log_image
from model import GPT, NonFiniteLogits

from .config import RunConfig
from .errors import LogError
from .events import EventWriter
from .streams import discard_stdout, stdout_lost

# The most pixels of the attention picture logged at each evaluation. Drawing and encoding one takes about 9 bytes a
# pixel, which the run's memory check does not count, beside the training step it runs with: under sample.py's bound
# (lab.heatmap.MAX_MAP_PIXELS) a 24-layer, 24-head model's 64 characters made 142M pixels, +1.15 GB and 10 s at every
# evaluation (2-core EPYC), and under a limit that the run's check passed, a MemoryError traceback at the first. This
# bound (about 150 MB, 1.2 s) still holds configs/shakespeare_char.yaml's 6 x 6 heads (9.3M pixels) and 8 x 8 heads
# whole; more heads show fewer of the 64 characters.
LOGGED_PIXELS = 2**24


class Throughput:
    """Training time and steps of the current logging interval. Its clock runs only while the loop trains: paused
    for evaluations, saves and logging, so that tokens/s and MFU describe training alone."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.seconds, self.steps = 0.0, 0
        self._since: float | None = None

    def resume(self) -> None:
        if self._since is None:
            self._since = self.clock()

    def count(self) -> None:
        """One more step trained in this interval."""
        self.steps += 1

    def pause(self) -> None:
        if self._since is not None:
            self.seconds += self.clock() - self._since
            self._since = None

    def take(self) -> tuple[int, float]:
        """(steps, seconds) of training since the last take, which starts the next interval; the clock is paused."""
        self.pause()
        taken = self.steps, self.seconds
        self.seconds, self.steps = 0.0, 0
        return taken


def utf8(text: str) -> str:
    """text as TensorBoard can write it (UTF-8 only): a file name's bytes that are not UTF-8 (a Latin-1 'café', held
    as "caf\\udce9") as the shell shows them, caf\\xe9; a lone surrogate escaped. data.path's such name was a
    UnicodeEncodeError traceback at the hyperparameters, as the run began."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


class Logger:
    """Progress to the terminal (a tqdm bar, or plain lines when output is not a terminal) and TensorBoard. A quiet
    Logger (every process of a torchrun launch but rank 0) shows and writes nothing."""

    def __init__(self, out_dir: Path, start: int, total: int, tensorboard: bool, progress: bool | None,
                 quiet: bool = False, on_closed: Callable[[], None] | None = None, resumed: bool = False) -> None:
        self.quiet = quiet
        self.on_closed = on_closed
        self._picture: threading.Thread | None = None  # the attention picture being drawn in the background
        self._picture_error: BaseException | None = None
        self._no_picture_said = False  # the note that the model's picture is too large, said once a run
        tensorboard = tensorboard and not quiet
        self.progress = False if quiet else sys.stderr.isatty() if progress is None else progress
        self.bar = None
        if self.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
        self.writer = None
        if tensorboard:
            # TensorBoard hides every earlier event at or after purge_step: those a killed or stopped run logged
            # past its last checkpoint, which this run logs again. Events at `start` itself were written before
            # that checkpoint (see flush) and stay (a resume logs at `start` only the evaluation a stop cut short,
            # which logged nothing), at step 0 too: a resume of a max_iters=0 run purged from 0 and lost its
            # evaluation at step 0. A fresh run owns every step, so one that died before its first checkpoint
            # leaves nothing behind.
            first = start + 1 if resumed else 0
            self.out_dir = out_dir
            with self.writing():
                self.writer = EventWriter(out_dir, purge_step=first)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """A block of TensorBoard writes: a write that fails (disk full, folder gone) stops the run with one line,
        and nothing more is written."""
        try:
            yield
        except OSError as e:
            writer, self.writer = self.writer, None
            if writer is not None:
                writer.close()  # nothing is pending there: each event was written when it was added
            said = f"cannot write TensorBoard logs into '{shown(str(self.out_dir))}' ({e.strerror or e})"
            if not os.path.isfile(os.path.join(self.out_dir, "ckpt.pt")):  # --resume would find nothing to resume
                raise LogError(f"{said}; no checkpoint had been saved yet. Free some space, or set "
                               f"train.tensorboard=false, and run the same command again") from None
            raise LogError(f"{said}; the last checkpoint there is intact. Free some space, or set "
                           f"train.tensorboard=false and --resume") from None

    def info(self, line: str) -> None:
        if self.quiet:
            return
        try:
            if self.bar is not None:
                self.bar.write(line)
            else:
                print(line, flush=True)
        except BrokenPipeError:  # the reader went away (`python train.py | head`): say nothing more, and stop
            self.quiet = True
            discard_stdout()
            if self.on_closed is not None:
                self.on_closed()
        except OSError as e:
            self.quiet = True
            stdout_lost(e)

    def step(self, step: int, n: int, postfix: dict[str, str] | None = None) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            with self.writing():
                for tag, value in values.items():
                    self.writer.add_scalar(tag, value, step)

    def text(self, step: int, tag: str, text: str) -> None:
        if self.writer is not None:
            with self.writing():
                self.writer.add_text(tag, text, step)

    def attention(self, step: int, model: GPT, ids: list[int], tokenizer: CharTokenizer,
                  background: bool = False) -> None:
        """The attention maps of every layer and head for a fixed prompt, as one image per evaluation (a GPT's: the
        other model types have no attention). background: the weights are taken here, and the picture is drawn,
        encoded and handed to the writer on a thread of its own while training goes on (on a GPU, where this
        process's CPU waits on the GPU: measured on an H200 host, the baby GPT's picture over 64 characters took
        0.7 s per evaluation). The next picture, flush(pictures=True) and close() wait for it."""
        if self.writer is None or model.config.type != "gpt":
            return
        self.finish_picture()
        chars = [tokenizer.chars[i] for i in ids]
        n_layer, n_head = model.config.n_layer, model.config.n_head
        limit = min(LOGGED_PIXELS, lab.heatmap.MAX_MAP_PIXELS)
        shown = characters_shown(n_layer, n_head, chars, title=f"step {step}", limit=limit)
        if shown == 0:  # not one character fits: no picture, rather than one of gigabytes at every evaluation
            if not self._no_picture_said:
                self._no_picture_said = True
                self.info(f"attention map: {too_large(n_layer, n_head, limit)}; not logged to TensorBoard")
            return
        ids, chars = ids[len(ids) - shown :], chars[len(chars) - shown :]  # a picture Pillow can open again
        weights = attention_weights(model, ids)  # on the CPU, as the model is now
        writer = self.writer

        def draw() -> None:
            log_image(writer, "attention/layers_x_heads", render_attention_grid(weights, chars, title=f"step {step}"),
                      step)

        if not background:
            with self.writing():
                draw()
            return
        self._picture = threading.Thread(target=self._drawing, args=(draw,), name="tinychar-attention", daemon=True)
        self._picture.start()

    def _drawing(self, draw: Callable[[], None]) -> None:
        try:
            draw()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it in finish_picture
            self._picture_error = e

    def finish_picture(self) -> None:
        """Wait for the picture drawn in the background, if any; what failed there is raised here."""
        if self._picture is not None:
            self._picture.join()
            self._picture = None
        error, self._picture_error = self._picture_error, None
        if error is not None:
            with self.writing():
                raise error

    def hparams(self, cfg: RunConfig, params: int) -> None:
        if self.writer is None:
            return
        flat = {k: (utf8(v) if isinstance(v, str) else v if isinstance(v, (int, float, bool)) else utf8(str(v)))
                for k, v in flatten(to_dict(cfg)).items()}
        flat["params"] = params
        with self.writing():
            self.writer.add_hparams(flat, ["hparam/best_val_loss"])
            self.writer.add_text("config", "```\n" + yaml.safe_dump(to_dict(cfg), sort_keys=False) + "```", 0)

    def flush(self, pictures: bool = True) -> None:
        """Every event logged so far in the file (each is written as it is logged; this waits for the picture drawn
        in the background); pictures=False: what that picture has not logged yet may come later."""
        if pictures:
            self.finish_picture()
        if self.writer is not None:
            with self.writing():
                self.writer.flush()

    def close(self) -> None:
        """Close the bar and the TensorBoard files; info() still prints, as plain lines."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        try:
            self.finish_picture()
        finally:  # the file is closed even when the picture failed
            if self.writer is not None:
                with self.writing():
                    self.writer.close()
                self.writer = None


def sample_text(model: GPT, tokenizer: CharTokenizer, n_chars: int, seed: int, device: torch.device,
                stop: Callable[[], bool] | None = None) -> str | None:
    """A short sample from the model for the logs, from a newline prompt, reproducible by seed; None if stop, asked
    after every character, said to stop (a Ctrl-C or SIGTERM waited for the whole sample: 442 s for 30,000
    characters at block 512, longer than a scheduler waits between SIGTERM and SIGKILL)."""
    start = "\n" if "\n" in tokenizer.chars else tokenizer.chars[0]
    idx = torch.tensor([tokenizer.encode(start)], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    # Not from a CUDA graph, as sample.py samples on a GPU: a capture begins by releasing PyTorch's cached GPU memory
    # (torch.cuda.empty_cache), and between compiled training steps that broke the run (an H200, torch 2.11,
    # configs/shakespeare_char.yaml: the training loss from 2.06 at step 250 to 3.0-3.5 in the next steps) until
    # inductor's mix-order reduction was turned off (training.compile_cache.CUDA_OPTIONS; a release no longer harms
    # the run, tested on an H100). A graph here would save 0.23 of the 0.48 s that these 200 characters take there,
    # not measured in training since.
    drawn = []
    try:
        for next_id in model.generate_iter(idx, n_chars, temperature=1.0, top_k=None, generator=gen):
            drawn.append(next_id)
            if stop is not None and stop():
                return None
    except NonFiniteLogits as e:  # logged in its place: a sample is no reason to stop the run
        return f"(no sample: {e})"
    finally:
        model.train(was_training)
    return tokenizer.decode(torch.cat([idx, *drawn], dim=1)[0].tolist())
