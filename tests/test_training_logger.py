"""Tests for training/logger.py: the throughput a run reports covers its training time exactly, and a closed output
is handled, not a crash."""

from __future__ import annotations

import contextlib
import errno
import io
from pathlib import Path

import pytest
import torch
from conftest import ROOT, tiny_overrides
from test_train import read_events

import train
import training.logger
import training.loop
from configs.userinput import shown
from data import CharTokenizer
from model import GPT, GPTConfig
from training.logger import Logger, Throughput

TINY = str(ROOT / "configs" / "tiny.yaml")


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_throughput_counts_only_the_time_it_runs() -> None:
    clock = FakeClock()
    meter = Throughput(clock)
    meter.resume()
    clock.now += 2.0
    meter.count()
    meter.pause()
    clock.now += 50.0  # an evaluation: not training
    meter.resume()
    meter.resume()  # a second resume changes nothing
    clock.now += 1.0
    meter.count()
    assert meter.take() == (2, 3.0)
    clock.now += 7.0  # paused by take: still not training
    meter.resume()
    clock.now += 0.5
    meter.count()
    assert meter.take() == (1, 0.5)


def test_tokens_per_second_cover_exactly_the_training_time_of_each_interval(tmp_path, monkeypatch) -> None:
    """Every training batch takes 10 ms of a fake clock and every evaluation 100 s: each logged tokens/s must be
    exactly tokens per step / 10 ms, for the intervals that straddle an evaluation too (eval_interval 7 and
    log_interval 5 fall out of step). Evaluation time leaking in would lower the figure; training time left out
    (the interval's clock restarting at an evaluation while its steps still count) would raise it."""
    clock = FakeClock()
    real_batch, real_estimate = training.loop.get_batch, training.loop.estimate_loss

    def batch(*args, **kwargs):
        clock.now += 0.010
        return real_batch(*args, **kwargs)

    def estimate(*args, **kwargs):
        clock.now += 100.0
        return real_estimate(*args, **kwargs)

    monkeypatch.setattr(training.loop, "get_batch", batch)
    monkeypatch.setattr(training.loop, "estimate_loss", estimate)
    monkeypatch.setattr(training.loop, "Throughput", lambda: Throughput(clock))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n" * 40, encoding="utf-8")
    out = tmp_path / "out"
    overrides = tiny_overrides(corpus, out, **{"train.max_iters": 30, "train.eval_interval": 7,
                                               "train.log_interval": 5, "train.batch_size": 4})
    with contextlib.redirect_stdout(io.StringIO()):
        assert train.main(["--config", TINY, *overrides], progress=False) == 0
    logged = read_events(out).Scalars("tokens_per_sec")
    assert [e.step for e in logged] == [5, 10, 15, 20, 25, 30]
    tokens_per_step = 4 * 8
    for event in logged:
        assert event.value == pytest.approx(tokens_per_step / 0.010, rel=1e-6), event.step


def test_a_closed_output_asks_the_run_to_stop_and_silences_the_logger(tmp_path: Path, monkeypatch) -> None:
    closed = []
    log = Logger(tmp_path, 0, 10, tensorboard=False, progress=False, on_closed=lambda: closed.append(True))

    def broken(*args, **kwargs):
        raise BrokenPipeError

    discarded = []
    monkeypatch.setattr("builtins.print", broken)
    monkeypatch.setattr("training.logger.discard_stdout", lambda: discarded.append(True))
    log.info("a line nobody reads")
    log.info("and another")
    assert closed == [True] and discarded == [True]  # once: the logger is quiet from then on


def test_a_full_disk_under_tensorboard_is_one_line_and_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    """When the disk fills under the TensorBoard logs, the run stops with one line (no traceback) and the checkpoint
    saved before is whole."""
    from model import load_checkpoint
    from training.events import EventWriter

    real_write = EventWriter._write
    writes = {"n": 0, "saved": False}

    def write(self, data):
        if writes["saved"]:  # the first checkpoint is on disk: from now on the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    real_save = training.loop.save_checkpoint

    def save(state, path, *copies):
        real_save(state, path, *copies)
        writes["saved"] = True

    monkeypatch.setattr(EventWriter, "_write", write)
    monkeypatch.setattr(training.loop, "save_checkpoint", save)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n" * 40, encoding="utf-8")
    out = tmp_path / "out"
    overrides = tiny_overrides(corpus, out, **{"train.max_iters": 30, "train.eval_interval": 10})
    code = train.main(["--config", TINY, *overrides], progress=False)
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().startswith(f"error: cannot write TensorBoard logs into '{shown(out)}' (No space left on "
                                  f"device); the last checkpoint there is intact"), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert load_checkpoint(out / "ckpt.pt")["step"] == 10


def test_a_full_disk_under_tensorboard_before_any_checkpoint_does_not_advise_a_resume(tmp_path, capsys, monkeypatch):
    """Full from the start: there was no checkpoint to be intact, and the --resume it advised found nothing."""
    from training.events import EventWriter

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(EventWriter, "_write", full)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n" * 40, encoding="utf-8")
    out = tmp_path / "out"
    code = train.main(["--config", TINY, *tiny_overrides(corpus, out, **{"train.max_iters": 30})], progress=False)
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and not (out / "ckpt.pt").exists()
    assert err.endswith("(No space left on device); no checkpoint had been saved yet. Free some space, or set "
                        "train.tensorboard=false, and run the same command again"), err


def _picture_logger(out_dir: Path) -> Logger:
    return Logger(out_dir, start=0, total=10, tensorboard=True, progress=False)


def _small_gpt():
    import torch

    from model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=5, block_size=8, n_layer=2, n_head=2, n_embd=8))


def test_the_attention_picture_drawn_in_the_background_is_the_one_drawn_in_line(tmp_path):
    # on a GPU the picture is drawn on a thread of its own while training goes on; what reaches TensorBoard is the
    # same PNG, at the same step, once flush() or close() has waited for it
    from data import CharTokenizer

    model, tokenizer, ids = _small_gpt(), CharTokenizer("abcde"), [0, 3, 1, 4, 2, 2]
    logged = {}
    for background in (False, True):
        log = _picture_logger(tmp_path / str(background))
        log.attention(3, model, ids, tokenizer, background=background)
        log.attention(5, model, ids, tokenizer, background=background)  # waits for the one before
        log.flush()
        logged[background] = [(p.step, p.encoded_image_string)
                              for p in read_events(tmp_path / str(background)).Images("attention/layers_x_heads")]
        log.close()
    assert [step for step, _ in logged[True]] == [3, 5]
    assert logged[True] == logged[False]


FAILURES = [(ValueError("a bug"), ValueError),
            (OSError(errno.ENOSPC, "No space left on device"), training.logger.LogError)]


@pytest.mark.parametrize(("failure", "expected"), FAILURES)
def test_a_failure_in_the_background_picture_is_raised_by_the_next_wait(tmp_path, monkeypatch, failure, expected):
    from data import CharTokenizer

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(training.logger, "render_attention_grid", fail)
    log = _picture_logger(tmp_path)
    log.attention(3, _small_gpt(), [0, 1, 2], CharTokenizer("abc"), background=True)
    with pytest.raises(expected):
        log.flush()
    log.flush()  # said once: the run stops there, and its closing is not the same failure again
    log.close()
    # a failure that close() is the first to see: raised there, and the files are closed all the same
    log = _picture_logger(tmp_path / "second")
    log.attention(4, _small_gpt(), [0, 1, 2], CharTokenizer("abc"), background=True)
    with pytest.raises(expected):
        log.close()
    assert log.writer is None


def test_the_logged_picture_is_one_pillow_can_open_again(tmp_path, monkeypatch):
    # a model with many layers and heads: the picture shows the last characters of the stretch that fit
    import lab.heatmap
    from data import CharTokenizer
    from lab.heatmap import grid_layout

    model, tokenizer, ids = _small_gpt(), CharTokenizer("abcde"), [0, 3, 1, 4, 2, 2, 1, 0]
    whole = grid_layout(2, 2, [tokenizer.chars[i] for i in ids], "step 3")
    monkeypatch.setattr(lab.heatmap, "MAX_MAP_PIXELS", whole.width * whole.height // 2)
    log = _picture_logger(tmp_path)
    log.attention(3, model, ids, tokenizer)
    log.flush()
    (picture,) = read_events(tmp_path).Images("attention/layers_x_heads")
    log.close()
    assert picture.width * picture.height <= whole.width * whole.height // 2
    shown = lab.heatmap.characters_shown(2, 2, [tokenizer.chars[i] for i in ids], "step 3")
    assert 1 <= shown < len(ids)
    layout = grid_layout(2, 2, [tokenizer.chars[i] for i in ids[-shown:]], "step 3")
    assert (picture.width, picture.height) == (layout.width, layout.height)


def test_the_logged_picture_of_many_heads_is_bounded_below_sample_py_s(tmp_path, monkeypatch):
    # 24 layers x 24 heads over 64 characters: 142M pixels, +1.15 GB and 10 s at every evaluation, which the run's
    # memory check does not count (a MemoryError traceback at the first evaluation under a limit the check passed)
    from data import CharTokenizer
    from lab.heatmap import MAX_MAP_PIXELS, grid_layout
    from model import GPT, GPTConfig

    drawn = []
    monkeypatch.setattr(training.logger, "render_attention_grid", lambda weights, chars, title: drawn.append(chars))
    monkeypatch.setattr(training.logger, "log_image", lambda *args: None)
    tokenizer = CharTokenizer("abcdefghijklmnopqrstuvwxyz")
    model = GPT(GPTConfig(vocab_size=26, block_size=64, n_layer=24, n_head=24, n_embd=24))
    log = _picture_logger(tmp_path)
    log.attention(3, model, [i % 26 for i in range(64)], tokenizer)
    log.close()
    (chars,) = drawn
    layout = grid_layout(24, 24, chars, "step 3")
    assert 1 <= len(chars) < 64 and layout.width * layout.height <= 2**24 < MAX_MAP_PIXELS


def test_a_model_too_large_for_any_picture_logs_none_and_says_so_once(tmp_path, monkeypatch):
    # 500 layers x 64 heads made a 313-million-pixel picture (+2.1 GB, +21 s) at every evaluation: past the bound
    # even for one character, no picture is drawn, and one line says so in the run
    import lab.heatmap
    from data import CharTokenizer

    one = lab.heatmap.grid_layout(2, 2, ["a"], "step 3")
    monkeypatch.setattr(lab.heatmap, "MAX_MAP_PIXELS", one.width * one.height - 1)
    monkeypatch.setattr(training.logger, "attention_weights", lambda *a: pytest.fail("weights taken for no picture"))
    said = []
    log = _picture_logger(tmp_path)
    monkeypatch.setattr(log, "info", said.append)
    for step in (3, 6):
        log.attention(step, _small_gpt(), [0, 1, 2], CharTokenizer("abc"))
    log.flush()
    assert read_events(tmp_path).Tags()["images"] == []
    log.close()
    assert said == [f"attention map: a picture of 2 layers x 2 heads is over {one.width * one.height - 1:,} pixels "
                    f"even for one character; not logged to TensorBoard"]


def test_a_sample_whose_logits_overflow_is_logged_as_none_and_the_model_left_as_it_was() -> None:
    """The training loop's own sample: GPT.generate now raises where the logits stop being finite numbers (it drew
    from the argmax of NaNs before); that must not end the run, whose losses and checkpoints are what matter."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=3, block_size=8, n_layer=1, n_head=1, n_embd=8))
    with torch.no_grad():
        model.lm_head.weight.fill_(3e38)  # finite weights whose logits overflow float32 from the first character
    text = training.logger.sample_text(model, CharTokenizer(["\n", "a", "b"]), 20, 1, torch.device("cpu"))
    assert text == "(no sample: the model's output is not a finite number (its weights are so large that float32 " \
                   "overflows))"
    assert model.training  # put back in training mode, as it came


def test_a_resume_from_step_0_keeps_the_evaluation_logged_there(tmp_path, capsys):
    """A max_iters=0 run evaluates its first weights at step 0; resumed for more steps, its new event file purged
    from step 0, so TensorBoard lost that evaluation (loss/val began at step 10), and the resume logged the config
    and hyperparameters a second time."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n" * 40, encoding="utf-8")
    out = tmp_path / "out"
    assert train.main(["--config", TINY, *tiny_overrides(corpus, out, **{"train.max_iters": 0})], progress=False) == 0
    first = read_events(out).Scalars("loss/val")
    assert [e.step for e in first] == [0]
    assert train.main(["--resume", "--out-dir", str(out), "train.max_iters=10"], progress=False) == 0
    capsys.readouterr()
    events = read_events(out)
    assert [(e.step, e.value) for e in events.Scalars("loss/val")][:1] == [(0, first[0].value)]
    assert [e.step for e in events.Scalars("loss/val")] == [0, 10]
    assert [e.step for e in events.Images("attention/layers_x_heads")] == [0, 10]
    assert [e.step for e in events.Tensors("config/text_summary")] == [0]
