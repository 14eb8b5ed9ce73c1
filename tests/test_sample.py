"""sample.py: stdout holds exactly the samples, seeds and greedy decoding are reproducible, streaming and the KV
cache change nothing, and bad requests are one line on stderr with exit status 2."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SMALL_TEXT, refused_with_imports, tiny_overrides, train_small_run
from PIL import Image

import sample
from data.paths import quoted
from model import load_checkpoint, model_from_checkpoint
from model.checkpoint import VERSION
from model.sampler import WindowSampler
from sampling import request, stops, writing
from training import linear_kernel

PROMPT = "First Citizen:\n"  # longer than block_size 8, so generation starts from a cropped context
GREEDY_PROMPT = "Caius Marc"  # where the greedy continuation of the tiny model is not one character repeated


TRAIN_KEYS = {"train.max_iters": 200, "train.eval_interval": 100, "train.log_interval": 100, "train.sample_chars": 0}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A tiny model trained once for this module, long enough that its greedy text varies."""
    return train_small_run(tmp_path_factory.mktemp("sample_run"), **TRAIN_KEYS)


@pytest.fixture
def run(run_dir, capsys):
    """sample.main on the module's run: (exit status, stdout, stderr)."""

    def call(*args: str, out_dir: Path | None = None) -> tuple[int, str, str]:
        capsys.readouterr()
        where = ["--out-dir", str(out_dir or run_dir)] if "--checkpoint" not in args and "--out-dir" not in args else []
        code = sample.main([*where, "--device", "cpu", *args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return call


def ok(result: tuple[int, str, str]) -> str:
    code, out, err = result
    assert code == 0, err
    assert "Traceback" not in err
    return out


def one_error_line(result: tuple[int, str, str]) -> str:
    code, out, err = result
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------------------------------- stdout


def test_one_sample_is_the_prompt_then_exactly_n_characters_and_a_newline(run, run_dir):
    code, out, err = run("--prompt", PROMPT, "--max-new-tokens", "37", "--num-samples", "1")
    assert code == 0
    assert len(out) == len(PROMPT) + 37 + 1
    assert out.startswith(PROMPT) and out.endswith("\n")
    assert set(out) <= set(SMALL_TEXT)
    # diagnostics go to stderr, naming the checkpoint it used
    assert "best.pt" in err and "parameters" in err and PROMPT not in err


def test_several_samples_are_separated_by_a_separator_line(run):
    n, new = 3, 12
    out = ok(run("--prompt", "All:", "--max-new-tokens", str(new), "--num-samples", str(n)))
    size = len("All:") + new + 1
    assert len(out) == n * size + (n - 1) * len(writing.SEPARATOR)
    samples = []
    for i in range(n):
        start = i * (size + len(writing.SEPARATOR))
        samples.append(out[start : start + size])
        assert samples[-1].startswith("All:") and samples[-1].endswith("\n")
        if i < n - 1:
            assert out[start + size : start + size + len(writing.SEPARATOR)] == writing.SEPARATOR
    assert writing.SEPARATOR.strip() and writing.SEPARATOR.endswith("\n")
    assert len(set(samples)) > 1  # each sample draws its own characters


def test_the_default_prompt_is_a_newline(run):
    out = ok(run("--max-new-tokens", "5"))
    assert out.startswith("\n") and len(out) == 1 + 5 + 1


def test_zero_new_tokens_prints_the_prompt_alone(run):
    assert ok(run("--prompt", "All:", "--max-new-tokens", "0")) == "All:\n"


def test_a_prompt_file_is_used_verbatim(run, tmp_path):
    (tmp_path / "crlf.txt").write_bytes(b"First Citizen:\r\nAll:\n")
    assert "\r" not in SMALL_TEXT
    # read as it is, not with universal newlines: the \r is a character the model never saw
    assert "'\\r'" in one_error_line(run("--prompt-file", str(tmp_path / "crlf.txt")))
    (tmp_path / "plain.txt").write_text("All:\nFirst", encoding="utf-8")
    out = ok(run("--prompt-file", str(tmp_path / "plain.txt"), "--max-new-tokens", "4"))
    assert out.startswith("All:\nFirst") and len(out) == len("All:\nFirst") + 4 + 1


def test_a_prompt_file_s_byte_order_mark_is_not_part_of_the_prompt(run, tmp_path):
    # Notepad's "UTF-8 with BOM": the mark says how the file is encoded; it is not text the model is to continue
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfAll:\nFirst")
    args = ("--max-new-tokens", "6", "--seed", "3")
    assert ok(run("--prompt-file", str(tmp_path / "bom.txt"), *args)) == ok(run("--prompt", "All:\nFirst", *args))
    (tmp_path / "only_bom.txt").write_bytes(b"\xef\xbb\xbf")
    line = one_error_line(run("--prompt-file", str(tmp_path / "only_bom.txt")))
    assert line.endswith("only_bom.txt' is empty; give a file of at least one character (or leave out --prompt-file)")


def test_the_checkpoint_line_quotes_only_an_integer_step(run, run_dir, tmp_path):
    payload = load_checkpoint(run_dir / "best.pt")
    for step, shown in (("x\n" * 5, "step ?"), (torch.arange(1000), "step ?"), (10**30, "step 1000...0000 (31 digits)"),
                        (True, "step ?")):
        payload["step"] = step
        torch.save(payload, tmp_path / "odd.pt")
        code, out, err = run("--checkpoint", str(tmp_path / "odd.pt"), "--max-new-tokens", "3")
        assert code == 0 and len(err.splitlines()) == 1, err[:500]
        assert f" parameters, {shown}, vocabulary" in err


# ------------------------------------------------------------------------------------- reproducibility


def test_a_path_that_starts_with_a_tilde_is_in_the_home_folder_as_train_py_takes_it(run, run_dir, tmp_path,
                                                                                      monkeypatch):
    """train.py 'out_dir=~/r' trains into the home folder and says to sample with --out-dir there; sample.py took '~'
    as a folder's name (and the shell leaves --out-dir=~/r as it is)."""
    home = tmp_path / "home"
    shutil.copytree(run_dir, home / "r")
    (home / "prompt.txt").write_text("All:", encoding="utf-8")
    monkeypatch.setenv("HOME", str(home))
    expected = ok(run("--max-new-tokens", "5", "--prompt", "All:"))
    assert ok(run("--out-dir=~/r", "--max-new-tokens", "5", "--prompt-file", "~/prompt.txt")) == expected
    assert ok(run("--checkpoint", "~/r/best.pt", "--max-new-tokens", "5", "--prompt", "All:")) == expected
    ok(run("--max-new-tokens", "0", "--prompt", "All:", "--attention-map", "~/map.png"))
    assert (home / "map.png").stat().st_size > 0


def test_the_same_seed_gives_the_same_text_and_another_seed_other_text(run):
    args = ("--prompt", PROMPT, "--max-new-tokens", "60", "--temperature", "1.0")
    first = ok(run(*args, "--seed", "11"))
    assert ok(run(*args, "--seed", "11")) == first
    assert ok(run(*args, "--seed", "12")) != first


def test_temperature_zero_is_greedy_whatever_the_seed(run, run_dir):
    greedy = ok(run("--prompt", GREEDY_PROMPT, "--max-new-tokens", "30", "--temperature", "0", "--seed", "1"))
    assert ok(run("--prompt", GREEDY_PROMPT, "--max-new-tokens", "30", "--temperature", "0", "--seed", "2")) == greedy
    assert len(set(greedy[len(GREEDY_PROMPT) :])) > 2  # not a degenerate repeat, so the comparison below bites
    # the same as always taking the likeliest character, computed here from the checkpoint
    model, vocab = model_from_checkpoint(load_checkpoint(run_dir / "best.pt"))
    model.eval()
    idx = torch.tensor([[vocab.index(c) for c in GREEDY_PROMPT]])
    with torch.no_grad():
        for _ in range(30):
            logits, _ = model(idx[:, -model.config.block_size :])
            idx = torch.cat([idx, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    assert greedy == "".join(vocab[i] for i in idx[0].tolist()) + "\n"


@pytest.mark.parametrize("narrowing", [["--top-k", "1"], ["--top-p", "1e-6"]])
def test_keeping_only_the_likeliest_character_is_greedy(run, narrowing):
    args = ("--prompt", GREEDY_PROMPT, "--max-new-tokens", "30")
    greedy = ok(run(*args, "--temperature", "0"))
    assert ok(run(*args, "--temperature", "1.5", "--seed", "2")) != greedy  # hot sampling wanders ...
    assert ok(run(*args, "--temperature", "1.5", "--seed", "2", *narrowing)) == greedy  # ... unless one choice is left


def test_top_k_and_top_p_still_sample(run):
    args = ("--prompt", PROMPT, "--max-new-tokens", "60", "--temperature", "1.0", "--top-k", "20", "--top-p", "0.95")
    first = ok(run(*args, "--seed", "3"))
    assert len(first) == len(PROMPT) + 60 + 1
    assert ok(run(*args, "--seed", "4")) != first


@pytest.mark.parametrize("variant", ["--stream", "--no-cache"])
def test_streaming_and_the_kv_cache_change_nothing(run, variant):
    # 40 new characters slide the 8-character window many times, where a stale cache would show
    args = ("--prompt", PROMPT, "--max-new-tokens", "40", "--num-samples", "2", "--seed", "5")
    assert ok(run(*args, variant)) == ok(run(*args))


def test_the_graph_path_gives_the_same_text_and_a_failed_capture_samples_eagerly(run, monkeypatch):
    # sample.py's path for a CUDA GPU (a chunk of characters a call from buffers kept on the device, captured as a
    # CUDA graph there; here nothing is captured), and, when the capture fails, one line and the eager path
    args = ("--prompt", PROMPT, "--max-new-tokens", "40", "--num-samples", "2", "--seed", "5")
    expected = ok(run(*args))
    monkeypatch.setattr(writing.compiling, "sampling_graphs", lambda device: True)
    code, out, err = run(*args)
    assert code == 0 and out == expected
    assert "sampling step captured as a CUDA graph in" in err

    def fail(self, batch, device):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(writing.WindowSampler, "warm_up", fail)
    code, out, err = run(*args)
    assert code == 0 and out == expected
    notes = [line for line in err.splitlines() if "CUDA graph" in line]
    assert notes == [("cannot capture a CUDA graph here (RuntimeError: CUDA error: operation not permitted when stream "
                      "is capturing); sampling eagerly")]


def test_a_stop_the_compiler_swallows_is_raised_again_until_sampling_stops(run, monkeypatch):
    """A library that catches the Ctrl-C (as inductor once did while compiling the training step) and works on: the
    signal is raised again until it ends the command, not when the compile is done. Here the CUDA graph's path,
    whose warm-up is the compile's, stands in for it: nothing is compiled."""
    from training import signals

    monkeypatch.setattr(writing.compiling, "sampling_graphs", lambda device: True)
    monkeypatch.setattr(signals, "INSIST_AFTER", 0.5)
    caught: list[BaseException] = []

    def compiling(self, batch, device):
        deadline, sent = time.monotonic() + 60, False
        while time.monotonic() < deadline:
            try:
                if not sent:  # only under tinychar's handler: without it, the signal would stop pytest itself
                    sent = isinstance(getattr(signal.getsignal(signal.SIGINT), "__self__", None), signals.StopSignals)
                    assert sent, "no tinychar handler for SIGINT while the sampler warms up"
                    signal.raise_signal(signal.SIGINT)
                time.sleep(0.01)
            except Exception as e:  # noqa: BLE001 - the library's
                if caught or isinstance(e, AssertionError):
                    raise
                caught.append(e)

    monkeypatch.setattr(writing.WindowSampler, "warm_up", compiling)
    begun = time.monotonic()
    code, out, err = run("--prompt", PROMPT, "--max-new-tokens", "40")
    assert code == 130 and time.monotonic() - begun < 30, err
    assert err.splitlines()[-1] == "interrupted (SIGINT); stopped sampling" and out == "", err
    assert len(caught) == 1 and isinstance(caught[0], signals.Interrupted)


def test_a_stop_that_an_import_wraps_while_the_sampler_is_made_still_ends_it_in_one_line(run, monkeypatch):
    """Ctrl-C landing inside the compiler's first import (torch.compile makes the sampler): Python 3.11 wraps an
    exception raised in a class's __set_name__ in a RuntimeError, which was a traceback (seen once in the suite)."""
    from training.signals import Interrupted

    made = writing.WindowSampler

    def interrupted(*args, graph=False, **kwargs):
        if graph:
            try:
                raise Interrupted(signal.SIGINT)
            except Interrupted as e:
                raise RuntimeError("Error calling __set_name__ on 'cached_property' instance 'adj'") from e
        return made(*args, graph=graph, **kwargs)

    monkeypatch.setattr(writing.compiling, "sampling_graphs", lambda device: True)  # the path that makes it at once
    monkeypatch.setattr(writing, "WindowSampler", interrupted)
    code, out, err = run("--prompt", PROMPT, "--max-new-tokens", "40")
    assert code == 130 and out == "" and err.strip().splitlines()[-1] == "interrupted (SIGINT); stopped sampling"


def test_a_stop_that_an_import_wraps_while_the_compiler_is_readied_still_ends_it_in_one_line(run, monkeypatch):
    """SIGTERM landing while compile_cache.prepare_compile imports inductor's lowering, whose kernel modules have
    jinja2 compile their templates: jinja2 reported the signal as a TemplateSyntaxError ("signal 15"), inductor
    wrapped that in its own, and sample.py ended in a traceback, status 1 (seen once in a CI run of the suite)."""
    from training.signals import Interrupted

    class TemplateSyntaxError(Exception):
        pass

    def preparing() -> None:
        try:
            raise Interrupted(signal.SIGTERM)
        except Interrupted as e:
            raise TemplateSyntaxError("signal 15") from e

    monkeypatch.setattr(writing.compile_cache, "prepare_compile", preparing)
    code, out, err = run("--prompt", PROMPT, "--max-new-tokens", "40", "--compile", "true")
    assert code == 143 and out == "" and err.strip().splitlines()[-1] == "interrupted (SIGTERM); stopped sampling"
    assert "Traceback" not in err


@pytest.mark.parametrize("applies", [True, False])
def test_compiled_sampling_on_a_cpu_computes_the_window_with_one_kernel_where_it_applies(run, monkeypatch, applies):
    """sample.py's compiled sampler on a CPU takes training/window_kernel.py's pass over its window where it applies
    (TINYCHAR_GEMM=1 here: auto takes it on the AMD CPUs where the linear kernel runs), and the linear layers' packed
    products where it does not. The sampler is run eagerly here (its wiring is what is checked; the compiled step's
    characters: test_model_sampler), and gives --compile false's text."""
    from training import window_kernel

    made: list[WindowSampler] = []

    def recorded(*args, **kwargs) -> WindowSampler:
        made.append(WindowSampler(*args, **{**kwargs, "compile": False, "ahead": None}))
        return made[-1]

    monkeypatch.setenv("TINYCHAR_GEMM", "1")
    monkeypatch.setattr(writing, "WindowSampler", recorded)
    if not applies:
        monkeypatch.setattr(window_kernel, "window_pass", lambda model, batch: None)
    compiled = ok(run("--prompt", PROMPT, "--max-new-tokens", "30", "--compile", "true"))
    (sampler,) = made
    assert window_kernel.shape_applies(sampler.model.config)  # the module's model is one the kernel takes
    assert (sampler.steps.pass_op is not None) == applies
    packed = [m for m in sampler.model.modules() if getattr(m, "packed", None) is not None]
    assert bool(packed) == (not applies) and bool(linear_kernel.layers_taking(sampler.model))
    monkeypatch.undo()
    assert compiled == ok(run("--prompt", PROMPT, "--max-new-tokens", "30", "--compile", "false"))


@pytest.mark.parametrize(("setting", "applies"), [("auto", True), ("auto", False), ("false", True),
                                                   ("true, failing", True)])
def test_eager_sampling_on_a_cpu_computes_the_window_with_one_kernel_on_every_thread_unless_compile_false(
        run, monkeypatch, tmp_path, setting, applies):
    """sample.py's eager sampler (--compile auto, a short text; or true where the compile fails) takes
    training/window_kernel.py's pass over its window, called from Python, where it applies (TINYCHAR_GEMM=1 here;
    auto: the AMD CPUs where the linear kernel runs), and with it every thread torch has, where this small a window
    otherwise runs on one; --compile false, the notes' code as written, never takes it. The text is the plain path's
    either way."""
    from training import window_kernel

    made: list[tuple[WindowSampler, int]] = []

    def recorded(*args, **kwargs) -> WindowSampler:
        made.append((WindowSampler(*args, **kwargs), torch.get_num_threads()))
        return made[-1][0]

    monkeypatch.setenv("TINYCHAR_GEMM", "1" if applies else "0")
    monkeypatch.setattr(writing, "WindowSampler", recorded)
    weighed, compiles = [], writing.compiling.sampling_compiles  # auto weighs compiling against the eager pass's speed
    monkeypatch.setattr(writing.compiling, "sampling_compiles", lambda *a: weighed.append(a[4]) or compiles(*a))
    if setting == "true, failing":  # the compile fails: sample.py samples eagerly
        monkeypatch.setattr(writing.compile_cache, "prepare_compile", lambda: tmp_path)
        monkeypatch.setattr(WindowSampler, "warm_up", lambda *a: (_ for _ in ()).throw(RuntimeError("no C++")))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        text = ok(run("--prompt", PROMPT, "--max-new-tokens", "30", "--compile", setting.split(",")[0]))
        assert torch.get_num_threads() == 2  # put back after sampling
    finally:
        torch.set_num_threads(threads)
    sampler, during = made[-1]  # the one that sampled (the second, where the compile failed)
    assert len(made) == (2 if setting == "true, failing" else 1)
    taken = setting != "false" and applies
    assert not sampler.fixed_shape and (sampler.steps.pass_op is window_kernel.window_hidden_in_python) == taken
    assert during == (2 if taken else 1) and weighed == [applies]
    if taken:
        monkeypatch.undo()
        assert text == ok(run("--prompt", PROMPT, "--max-new-tokens", "30", "--no-cache"))


def test_sampling_without_compiling_never_asks_for_the_compiler_s_settings(run, monkeypatch):
    """On CUDA, reading inductor's options imports inductor, seconds that sample.py paid on every GPU run, compiling
    or not (an H200's first character came 5.2 s after the checkpoint had loaded)."""
    def options(device):
        raise AssertionError("inductor's options read with nothing to compile")

    monkeypatch.setattr(writing.compile_cache, "compile_options", options)
    monkeypatch.setattr(writing.compiling, "sampling_graphs", lambda device: True)  # the CUDA path, as above
    code, out, err = run("--prompt", PROMPT, "--max-new-tokens", "20", "--compile", "false")
    assert code == 0 and len(out) == len(PROMPT) + 20 + 1 and "captured as a CUDA graph" in err, err


@pytest.mark.parametrize("plain", [["--no-cache"], ["--temperature", "1e-5"], "bigram"],
                         ids=["no-cache", "vanishing-temperature", "bigram"])
def test_compile_true_on_the_plain_path_says_it_samples_without_compiling(run, tmp_path, plain):
    if plain == "bigram":
        plain = ["--out-dir", str(train_small_run(tmp_path, **{"model.type": "bigram", "train.max_iters": 2,
                                                                "train.eval_interval": 2, "train.sample_chars": 0}))]
    code, out, err = run("--prompt", "All:", "--max-new-tokens", "3", "--compile", "true", *plain)
    assert code == 0 and len(out) == len("All:") + 3 + 1
    (note,) = [line for line in err.splitlines() if line.startswith("--compile true, but")]
    assert note.endswith("takes the plain path: sampling without compiling") or "bigram model samples" in note


def test_an_eager_sample_notes_what_a_character_took_for_compile_auto(run, monkeypatch, tmp_path):
    """--compile auto compiles once compiling was measured to win here (sampling.compiling.sampling_compiles): each
    sample on a CPU that samples as auto does eagerly notes its milliseconds a character, unless too short to time,
    streamed (its writes wait on the reader), or stopped before the end. --compile false is auto's eager path only
    where the window's pass does not apply (training/window_kernel.py; TINYCHAR_GEMM=1 here: it applies)."""
    monkeypatch.setattr(writing.compile_cache, "_USER_CACHE", str(tmp_path))
    monkeypatch.setenv("TINYCHAR_GEMM", "1")
    markers = lambda: sorted(tmp_path.glob("*/tinychar-sample-*.json"))  # noqa: E731
    enough = str(writing.TIMED_MIN_STEPS)
    ok(run("--max-new-tokens", str(writing.TIMED_MIN_STEPS - 1)))
    ok(run("--max-new-tokens", enough, "--stream"))
    ok(run("--max-new-tokens", enough, "--compile", "false"))  # without the pass that auto takes
    assert markers() == []
    ok(run("--max-new-tokens", enough))  # auto: too few characters to compile
    ok(run("--max-new-tokens", enough, "--num-samples", "2"))
    one, two = (json.loads(path.read_text(encoding="utf-8")) for path in markers())  # a marker for each batch
    assert set(one) == set(two) == {"eager_ms"} and 0 < one["eager_ms"] < 1000 and 0 < two["eager_ms"] < 1000
    monkeypatch.setenv("TINYCHAR_GEMM", "0")  # no pass: --compile false samples as auto would, under another key
    ok(run("--max-new-tokens", enough, "--compile", "false"))
    assert len(markers()) == 3
    monkeypatch.setenv("TINYCHAR_GEMM", "1")

    def drawn(count: int, stop_after: int) -> list[int]:
        got = []
        for step in writing.timed_steps(iter(range(count)), "sample-timed", "compiled_ms", count):
            got.append(step)
            if len(got) == stop_after:
                break
        return got

    # a compile that failed samples eagerly, and is timed as what it is
    for path in markers():
        path.unlink()
    monkeypatch.setattr(writing.compile_cache, "prepare_compile", lambda: tmp_path)
    monkeypatch.setattr(writing.WindowSampler, "warm_up", lambda *a: (_ for _ in ()).throw(RuntimeError("no C++")))
    code, out, err = run("--max-new-tokens", enough, "--compile", "true")
    assert code == 0 and "sampling eagerly" in err, err
    (path,) = markers()
    assert set(json.loads(path.read_text(encoding="utf-8"))) == {"eager_ms"}

    key_marker = writing.compile_cache._marker("sample-timed")
    assert drawn(5, stop_after=3) == [0, 1, 2] and not key_marker.exists()  # stopped early: not noted
    assert drawn(5, stop_after=0) == [0, 1, 2, 3, 4]
    assert set(json.loads(key_marker.read_text(encoding="utf-8"))) == {"compiled_ms"}


def test_a_cpu_sample_takes_the_step_saved_whole_and_says_when_it_was_loaded(run, monkeypatch, tmp_path):
    """--compile on a CPU: the sampling step comes from training.step_file (compiled and saved, or loaded as saved);
    a load is said as one, and noted as a compile from the warm cache. Where step_file fails, torch.compile's own step
    samples. Here nothing compiles: the functions given run eagerly."""
    args = ("--prompt", PROMPT, "--max-new-tokens", "30", "--num-samples", "2", "--seed", "3")
    expected = ok(run(*args, "--compile", "false"))
    # importing the compiler, which only a compile needs, is part of what --compile auto weighs (here 0.2 s)
    monkeypatch.setattr(writing.compile_cache, "prepare_compile", lambda: time.sleep(0.2) or tmp_path)
    monkeypatch.setattr(writing.step_file, "AHEAD", True)
    noted: list[tuple[float, bool]] = []
    monkeypatch.setattr(writing.compile_cache, "remember_compile",
                        lambda key, seconds, cold: noted.append((seconds >= 0.2, cold)))
    monkeypatch.setattr(writing.compile_cache, "cached_compile_seconds", lambda key: None)  # never compiled here
    came = iter(["compiled", "loaded"])
    monkeypatch.setattr(writing.step_file, "step_function", lambda fn, args, device: (fn, next(came)))
    code, out, err = run(*args, "--compile", "true")
    assert code == 0 and out == expected and "sampling step compiled in" in err, err
    code, out, err = run(*args, "--compile", "true")
    assert code == 0 and out == expected and "sampling step loaded in" in err, err
    assert noted == [(True, True), (True, False)]  # the first from an empty cache; a load is no cold compile

    def fails(fn, args, device):
        raise RuntimeError("aot_compile cannot trace this")

    guarded: list[object] = []
    monkeypatch.setattr(writing.step_file, "step_function", fails)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: guarded.append(fn) or fn)
    code, out, err = run(*args, "--compile", "true")
    assert code == 0 and out == expected and "sampling step compiled in" in err and len(guarded) == 1, err


def test_nothing_is_compiled_for_no_new_characters(run, monkeypatch):
    def compile(*args, **kwargs):
        raise AssertionError("compiled (or captured) for no characters")

    monkeypatch.setattr(writing.WindowSampler, "warm_up", compile)
    monkeypatch.setattr(writing.compiling, "sampling_graphs", lambda device: True)
    code, out, err = run("--prompt", "All:", "--max-new-tokens", "0", "--compile", "true")
    assert code == 0 and out == "All:\n" and "compiled" not in err and "captured" not in err, err


def test_a_text_too_long_for_memory_is_refused_before_the_model_is_built(run, monkeypatch):
    # the samples' ids are kept until they are written (5 bytes a character in the CPU's memory, 8 more on the
    # device for the plain paths): a request whose text cannot fit is one line, before anything is built or sampled
    import training.memory

    monkeypatch.setattr(training.memory, "available_bytes", lambda device: 2 * 10**9)
    built = []
    monkeypatch.setattr(request, "model_from_checkpoint", lambda *a: built.append(1))
    line = one_error_line(run("--num-samples", "1000", "--max-new-tokens", "200000"))  # 2.6 GB of ids
    assert "needs about 2.6 GB of memory and this machine has 2.0 GB free" in line
    assert line.endswith("ask for fewer --num-samples or a smaller --max-new-tokens") and not built
    # the prompt's window counts, the rest of it not: a model reads no more (1000 samples of a 100,000-character
    # prompt counted 0.8 GB more; 100 of a 5 MB prompt took 4 GB)
    monkeypatch.setattr(training.memory, "available_bytes", lambda device: 10**8)
    short, long = (one_error_line(run("--num-samples", "1000", "--max-new-tokens", "30000", "--prompt", prompt))
                   for prompt in ("a", "a" * 100_000))
    assert "needs about 0.4 GB" in short and short == long


def test_a_long_prompt_is_written_whole_and_continued_from_its_last_block_size_characters(run, run_dir):
    block = load_checkpoint(run_dir / "ckpt.pt")["config"]["model"]["block_size"]
    prompt = "".join(PROMPT[i % len(PROMPT)] for i in range(5_000))
    window = prompt[-block:]
    for args in ((), ("--no-cache",), ("--num-samples", "3")):
        whole = ok(run("--prompt", prompt, "--max-new-tokens", "40", *args)).split(writing.SEPARATOR)
        cropped = ok(run("--prompt", window, "--max-new-tokens", "40", *args)).split(writing.SEPARATOR)
        assert len(whole) == len(cropped) == (3 if "--num-samples" in args else 1)
        assert whole == [prompt + sample[len(window):] for sample in cropped]


def test_a_batch_too_large_for_memory_is_blamed_on_the_number_of_samples_not_the_model(run, monkeypatch):
    # a million samples of 5 characters: their windows and KV caches are nearly all of the need, and one sample
    # fits, so the advice is fewer samples; a machine where not even one fits is told the model is too large
    import training.memory

    monkeypatch.setattr(training.memory, "available_bytes", lambda device: 2 * 10**9)
    line = one_error_line(run("--num-samples", "1000000", "--max-new-tokens", "5"))
    assert line.endswith("of memory and this machine has 2.0 GB free; ask for fewer --num-samples (one sample fits)")
    assert "model" not in line
    monkeypatch.setattr(training.memory, "available_bytes", lambda device: 1000)
    line = one_error_line(run("--num-samples", "1000000", "--max-new-tokens", "5"))
    assert line.endswith("this machine has 0 MB free; it describes a model too large for this machine")


def test_an_attention_map_too_large_to_open_is_drawn_over_the_last_characters_and_says_so(run, tmp_path,
                                                                                         monkeypatch):
    import lab.heatmap

    picture = tmp_path / "map.png"
    code, _, err = run("--prompt", PROMPT, "--max-new-tokens", "5", "--attention-map", str(picture))
    assert code == 0 and "attention map: the last" not in err  # 8 characters: nothing left out
    with Image.open(picture) as image:
        whole = image.size
    monkeypatch.setattr(lab.heatmap, "MAX_MAP_PIXELS", whole[0] * whole[1] // 2)
    code, _, err = run("--prompt", PROMPT, "--max-new-tokens", "5", "--attention-map", str(picture))
    assert code == 0
    (note,) = [line for line in err.splitlines() if line.startswith("attention map: the last")]
    assert note.endswith("characters of the prompt's 8 (a picture of them all would be too large to open)")
    with Image.open(picture) as image:
        assert image.size[0] * image.size[1] <= whole[0] * whole[1] // 2


def test_an_attention_map_that_runs_out_of_memory_is_one_line_and_no_picture(run, tmp_path, monkeypatch):
    # Pillow raises MemoryError where the picture's pixels do not fit (a 24-layer, 24-head model's 64 characters
    # under a 1.2 GB limit, from the Image.new that draws the grid): a traceback, since the memory check counts no
    # picture
    import lab.heatmap

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(lab.heatmap, "render_attention_grid", no_memory)
    code, out, err = run("--prompt", PROMPT, "--max-new-tokens", "5", "--attention-map", str(tmp_path / "map.png"))
    assert (code, out) == (1, "") and "Traceback" not in err
    assert err.splitlines()[-1] == ("error: out of memory drawing the --attention-map of 8 characters x 2 layers x 2 "
                                    "heads; give a shorter --prompt, or leave --attention-map out")
    assert list(tmp_path.iterdir()) == []


def test_an_attention_map_is_written_in_the_format_its_name_says(run, tmp_path):
    code, _, err = run("--prompt", PROMPT, "--max-new-tokens", "0", "--attention-map", str(tmp_path / "map.jpg"))
    assert code == 0, err
    with Image.open(tmp_path / "map.jpg") as image:
        assert image.format == "JPEG"
    line = one_error_line(run("--prompt", PROMPT, "--attention-map", str(tmp_path / "map.xyz")))
    assert line.endswith("map.xyz': Pillow cannot write '.xyz' pictures; name it .png (or .jpg, .webp, .gif, ...)")


def test_attention_values_write_the_weights_into_a_larger_map_and_need_one(run, tmp_path):
    line = one_error_line(run("--prompt", PROMPT, "--attention-values"))
    assert line == ("error: --attention-values writes the weights into the --attention-map picture; give that too "
                    "(--attention-map FILE.png)")
    for name, extra in (("plain.png", ()), ("values.png", ("--attention-values",))):
        code, _, err = run("--prompt", PROMPT, "--max-new-tokens", "0", "--attention-map", str(tmp_path / name), *extra)
        assert code == 0, err
    with Image.open(tmp_path / "plain.png") as plain, Image.open(tmp_path / "values.png") as values:
        assert values.height > plain.height and values.width >= plain.width  # (the title may set the width)


def test_an_attention_map_never_replaces_the_checkpoint_a_pipe_or_a_link(run, run_dir, tmp_path):
    # Written to a temporary file renamed over its path, the picture replaced whatever was there: the checkpoint being
    # sampled (named without an extension, so as PNG), a run's .lock, a named pipe, a device, a symbolic link.
    shutil.copyfile(run_dir / "best.pt", tmp_path / "model")
    os.mkfifo(tmp_path / "pipe")
    for name, says in (("model", "a file that is not a picture is there"), ("pipe", "it is not a plain file")):
        line = one_error_line(run("--checkpoint", str(tmp_path / "model"), "--attention-map", str(tmp_path / name)))
        assert f"--attention-map {quoted(tmp_path / name)}: {says}" in line
    assert (tmp_path / "model").read_bytes() == (run_dir / "best.pt").read_bytes() and (tmp_path / "pipe").is_fifo()
    # a link to a picture stays a link: the picture it leads to is written
    Image.new("RGB", (2, 2)).save(tmp_path / "old.png")
    (tmp_path / "map.png").symlink_to(tmp_path / "old.png")
    code, _, err = run("--prompt", PROMPT, "--max-new-tokens", "0", "--attention-map", str(tmp_path / "map.png"))
    assert code == 0, err
    assert (tmp_path / "map.png").is_symlink()
    with Image.open(tmp_path / "old.png") as image:
        assert image.size != (2, 2)


def test_an_attention_map_onto_the_samples_own_file_is_refused_before_the_checkpoint_is_read(tmp_path):
    # `--attention-map /dev/stdout > samples.txt` exited 0 with samples.txt a PNG: the shell's empty file passed for
    # one a picture may replace, and the samples went to the old, unlinked file. A checkpoint that is not one shows
    # the map is refused before anything is loaded.
    (tmp_path / "model.pt").write_text("not a checkpoint\n", encoding="utf-8")
    for stream in ("stdout", "stderr"):
        with open(tmp_path / "samples.txt", "wb") as out:
            done = subprocess.run([sys.executable, str(ROOT / "sample.py"), "--checkpoint", str(tmp_path / "model.pt"),
                                   "--attention-map", f"/dev/{stream}"],
                                  stdout=out if stream == "stdout" else subprocess.DEVNULL,
                                  stderr=out if stream == "stderr" else subprocess.PIPE, timeout=120, check=False)
        said = (tmp_path / "samples.txt").read_bytes() if stream == "stderr" else done.stderr
        assert done.returncode == 2 and said.decode() == (
            f"error: --attention-map '/dev/{stream}': it is where this command's output ({stream}) is written, which "
            f"the picture would replace; name a picture file\n")
        assert stream == "stderr" or (tmp_path / "samples.txt").read_bytes() == b""


def test_an_attention_map_into_a_folder_that_takes_no_file_is_refused_before_the_model_is_built(run, monkeypatch):
    # /proc takes no new file, root's included, for whom os.access allows everything: sample.py sampled, then failed
    monkeypatch.setattr(request, "model_from_checkpoint", lambda *a: pytest.fail("the model was built"))
    line = one_error_line(run("--prompt", PROMPT, "--attention-map", "/proc/map.png"))
    assert line.startswith("error: --attention-map '/proc/map.png': the folder '/proc' cannot be written"), line
    assert line.endswith("give another path")


def test_an_attention_map_too_large_for_one_character_is_refused_before_the_model_is_built(run, monkeypatch,
                                                                                           tmp_path):
    import lab.heatmap

    monkeypatch.setattr(lab.heatmap, "MAX_MAP_PIXELS", 1000)
    monkeypatch.setattr(request, "model_from_checkpoint", lambda *a: pytest.fail("the model was built"))
    line = one_error_line(run("--prompt", PROMPT, "--attention-map", str(tmp_path / "map.png")))
    assert line.endswith("heads is over 1,000 pixels even for one character; leave out --attention-map")
    assert not (tmp_path / "map.png").exists()


# ---------------------------------------------------------------------------------------- where from


def test_out_dir_falls_back_to_ckpt_pt(run, run_dir, tmp_path):
    only_ckpt = tmp_path / "only_ckpt"
    only_ckpt.mkdir()
    shutil.copy(run_dir / "ckpt.pt", only_ckpt / "ckpt.pt")
    code, out, err = run("--prompt", "All:", "--max-new-tokens", "5", out_dir=only_ckpt)
    assert code == 0 and "ckpt.pt" in err and len(out) == len("All:") + 5 + 1


def test_out_dir_prefers_best_pt(run, run_dir, tmp_path):
    # a best.pt and a ckpt.pt that differ: the greedy text shows which one was read
    both = tmp_path / "both"
    both.mkdir()
    shutil.copy(run_dir / "best.pt", both / "best.pt")
    payload = load_checkpoint(run_dir / "best.pt")
    gen = torch.Generator().manual_seed(0)
    payload["model"] = {k: torch.randn(v.shape, generator=gen) for k, v in payload["model"].items()}
    torch.save(payload, both / "ckpt.pt")
    args = ("--prompt", GREEDY_PROMPT, "--max-new-tokens", "20", "--temperature", "0")
    assert ok(run(*args, out_dir=both)) == ok(run(*args, out_dir=run_dir))
    assert ok(run(*args, "--checkpoint", str(both / "ckpt.pt"))) != ok(run(*args, out_dir=both))


def test_a_checkpoint_alone_is_enough_to_sample(run, run_dir, tmp_path):
    lonely = tmp_path / "elsewhere" / "model.pt"
    lonely.parent.mkdir()
    shutil.copy(run_dir / "best.pt", lonely)
    args = ("--prompt", PROMPT, "--max-new-tokens", "20", "--seed", "9")
    assert ok(run(*args, "--checkpoint", str(lonely))) == ok(run(*args))


# ------------------------------------------------------------------------------------------- bad input


def _truncated(run_dir: Path, tmp_path: Path) -> list[str]:
    data = (run_dir / "best.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 3])
    return ["--checkpoint", str(tmp_path / "cut.pt")]


def _overflowing(run_dir: Path, tmp_path: Path) -> list[str]:
    """A checkpoint of finite weights that overflow float32 in the forward pass (3e38, float32's largest is 3.4e38)."""
    payload = torch.load(run_dir / "best.pt", weights_only=True)
    for name in ("transformer.ln_f.weight", "lm_head.weight"):
        payload["model"][name] = torch.full_like(payload["model"][name], 3e38)
    torch.save(payload, tmp_path / "huge.pt")
    return ["--checkpoint", str(tmp_path / "huge.pt")]


def _file(tmp_path: Path, name: str, content: bytes) -> str:
    (tmp_path / name).write_bytes(content)
    return str(tmp_path / name)


def _empty_folder(run_dir: Path, tmp_path: Path) -> list[str]:
    (tmp_path / "empty").mkdir()
    return ["--out-dir", str(tmp_path / "empty")]


def _left_aside(run_dir: Path, tmp_path: Path) -> list[str]:
    """A folder as an --overwrite run killed before its first checkpoint leaves it: the old run in .replaced/."""
    (tmp_path / "replacing" / ".replaced").mkdir(parents=True)
    shutil.copyfile(run_dir / "best.pt", tmp_path / "replacing" / ".replaced" / "best.pt")
    return ["--out-dir", str(tmp_path / "replacing")]


BAD_REQUESTS = [
    ("empty-prompt", lambda r, t: ["--prompt", ""], "prompt is empty"),
    ("negative-max-new-tokens", lambda r, t: ["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
    ("top-k-zero", lambda r, t: ["--top-k", "0"], "--top-k must be >= 1"),
    ("top-p-above-one", lambda r, t: ["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    ("top-p-zero", lambda r, t: ["--top-p", "0"], "--top-p must be in (0, 1]"),
    ("negative-temperature", lambda r, t: ["--temperature", "-1"], "--temperature must be"),
    ("nan-temperature", lambda r, t: ["--temperature", "nan"], "--temperature must be"),
    ("zero-samples", lambda r, t: ["--num-samples", "0"], "--num-samples must be >= 1"),
    ("missing-out-dir", lambda r, t: ["--out-dir", str(t / "no_such_run")], "no run folder"),
    ("out-dir-without-checkpoints", _empty_folder, "holds no best.pt or ckpt.pt"),
    ("out-dir-replaced-midway", _left_aside, "holds no best.pt or ckpt.pt of its own: the run that an --overwrite "
     "replaced waits in"),
    ("missing-checkpoint", lambda r, t: ["--checkpoint", str(t / "nope.pt")], "no checkpoint at"),
    ("truncated-checkpoint", _truncated, "truncated or not a checkpoint"),
    ("overflowing-weights", _overflowing, "huge.pt': the model's output is not a finite number"),
    ("overflowing-weights-no-cache", lambda r, t: [*_overflowing(r, t), "--no-cache"], "not a finite number"),
    ("overflowing-weights-greedy", lambda r, t: [*_overflowing(r, t), "--temperature", "0"], "not a finite number"),
    ("missing-prompt-file", lambda r, t: ["--prompt-file", str(t / "nope.txt")], "no such file"),
    ("prompt-file-dash", lambda r, t: ["--prompt-file", "-"],  # was "no such file '-'"
     "--prompt-file reads a file, not standard input ('-'); save the text in a file and give its path, or give"),
    ("unknown-device", lambda r, t: ["--device", "abacus"], "unknown device 'abacus'"),
    ("empty-prompt-file", lambda r, t: ["--prompt-file", _file(t, "empty.txt", b"")],
     "empty.txt' is empty; give a file of at least one character (or leave out --prompt-file)"),
    ("prompt-not-utf-8", lambda r, t: ["--prompt", "caf\udce9"],  # b'caf\xe9' in argv, as Python hands it over
     "--prompt is not UTF-8 text (byte 0xe9 at character 3)"),
    ("empty-out-dir", lambda r, t: ["--out-dir", ""], "--out-dir is empty; give a run folder"),
    ("empty-checkpoint", lambda r, t: ["--checkpoint", ""], "--checkpoint is empty; give a checkpoint file"),
    ("empty-attention-map", lambda r, t: ["--attention-map", ""], "--attention-map is empty"),
    ("out-dir-a-checkpoint", lambda r, t: ["--out-dir", str(r / "best.pt")],
     "best.pt' is a file, not a run folder; to sample from it, pass it as --checkpoint"),
    ("out-dir-a-device", lambda r, t: ["--out-dir", "/dev/null"],  # was "no run folder '/dev/null'"
     "--out-dir '/dev/null' is a character device, not a run folder; give the folder a run wrote"),
    ("out-dir-a-device-slash", lambda r, t: ["--out-dir", "/dev/null/"],
     "--out-dir '/dev/null/' is a character device, not a run folder; give the folder a run wrote"),
]


@pytest.mark.parametrize(("make", "fragment"), [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_a_bad_request_is_one_line_and_exit_2(run, run_dir, tmp_path, make, fragment):
    # (the run fixture passes --device cpu first; a later --device wins)
    assert fragment in one_error_line(run(*make(run_dir, tmp_path)))


@pytest.mark.slow
@pytest.mark.parametrize(("args", "fragment"), [
    (["--out-dir", "no_such_run"], "no run folder 'no_such_run'; train one with `python train.py`"),
    ([], "no run folder 'runs/tiny'"),  # sample.py before any training, as the README's order may be missed
    (["--out-dir", "empty"], "'empty' holds no best.pt or ckpt.pt; train first"),
    (["--out-dir", "a_file"], "--out-dir 'a_file' is a file, not a run folder"),
    (["--out-dir", "a_file/"], "--out-dir 'a_file/' is a file, not a run folder"),  # was "no run folder 'a_file'"
    (["--out-dir", "replacing"], "'replacing' holds no best.pt or ckpt.pt of its own: the run that an --overwrite "
     "replaced waits in 'replacing/.replaced'"),
    (["--checkpoint", "nope.pt"], "no checkpoint at 'nope.pt'; train one first with `python train.py`"),
    (["--checkpoint", "dangling.pt"], "'dangling.pt' is a symbolic link that leads to no file"),
    (["--checkpoint", "empty"], "'empty' is a folder, not a checkpoint file; name the checkpoint in it"),
], ids=["missing", "default", "empty", "file", "file-with-a-slash", "replaced-midway", "missing-checkpoint",
        "dangling-link", "checkpoint-a-folder"])
def test_a_run_folder_or_checkpoint_not_there_is_said_before_torch_is_imported(tmp_path, args, fragment):
    """The commonest mistake with sample.py, a run folder (or checkpoint) mistyped or not trained yet, was said once
    torch had loaded, 1.75-1.89 s after the command (2-core Zen 2 EPYC); now in 0.15 s, by a process that never
    imports torch."""
    (tmp_path / "dangling.pt").symlink_to(tmp_path / "gone.pt")
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("not a run\n", encoding="utf-8")
    (tmp_path / "replacing" / ".replaced").mkdir(parents=True)
    (tmp_path / "replacing" / ".replaced" / "best.pt").write_bytes(b"the run an --overwrite replaced")
    said, imported = refused_with_imports("sample.py", args, tmp_path)
    assert fragment in said, said
    assert "sampling.options" in imported and not any(name.split(".")[0] in ("torch", "numpy") for name in imported)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "content", "fragment"), [
    ("nope.txt", None, "--prompt-file: no such file 'nope.txt'"),
    ("empty.txt", b"", "--prompt-file: 'empty.txt' is empty; give a file of at least one character"),
    ("only_bom.txt", b"\xef\xbb\xbf", "--prompt-file: 'only_bom.txt' is empty"),
    ("latin1.txt", "Caf\u00e9".encode("latin-1"), "--prompt-file: 'latin1.txt' is not UTF-8 (byte 0xe9 at offset 3)"),
    ("folder", "folder", "--prompt-file: 'folder' is a folder, not a file"),
], ids=["missing", "empty", "only-a-byte-order-mark", "latin-1", "a-folder"])
def test_a_prompt_file_that_cannot_be_the_prompt_is_said_before_torch_is_imported(tmp_path, name, content, fragment):
    """A --prompt-file mistyped, empty or in another encoding was refused once torch and the checkpoint had loaded;
    now the file is read (once) before torch, and the process that refuses it never imports torch. The checkpoint
    named is only a placeholder: the prompt is read before any checkpoint is opened."""
    if content == "folder":
        (tmp_path / name).mkdir()
    elif content is not None:
        (tmp_path / name).write_bytes(content)
    (tmp_path / "any.pt").write_bytes(b"read only once the prompt has passed")
    said, imported = refused_with_imports("sample.py", ["--checkpoint", "any.pt", "--prompt-file", name], tmp_path)
    assert fragment in said, said
    assert "sampling.options" in imported and not any(module.split(".")[0] in ("torch", "numpy") for module in imported)


def _overflowing_later(run_dir: Path, tmp_path: Path, prompt: str) -> tuple[Path, str]:
    """A checkpoint whose output is finite for prompt (which sample.py's probe checks) but not one character later: a
    character's embedding, tied to its row of the head, set along the prompt's last final state so that its logit is
    1e38 there (drawn for sure) and its embedding overflows float32 in the next window. (The character and it.)"""
    payload = torch.load(run_dir / "best.pt", weights_only=True)
    model, vocab = model_from_checkpoint(payload, run_dir / "best.pt")
    with torch.no_grad():
        state = model.eval().hidden(torch.tensor([[vocab.index(c) for c in prompt]]))[0][0, -1]
    char = next(i for i, c in enumerate(vocab) if i > 0 and c not in prompt)  # not 0: see tests/test_model_sampler.py
    for name in ("transformer.wte.weight", "lm_head.weight"):  # both names of the one tied matrix
        payload["model"][name][char] = state / state.norm() ** 2 * 1e38
    torch.save(payload, tmp_path / "late.pt")
    return tmp_path / "late.pt", vocab[char]


@pytest.mark.parametrize("how", [[], ["--no-cache"], ["--temperature", "0"], ["--no-cache", "--temperature", "0"],
                                 ["--compile", "false", "--num-samples", "2"], ["--num-samples", "3"]])
@pytest.mark.parametrize("stream", [["--stream"], []])
def test_an_output_that_overflows_partway_through_is_one_line_and_exit_2_on_every_path(run, run_dir, tmp_path, how,
                                                                                       stream):
    """Finite for the prompt, which the probe checks, but not one character later. The default path ended in
    torch.multinomial's traceback, and the others printed a text of one or two characters over and over, exit 0.
    Every sample keeps the characters drawn before, streamed or not (without --stream they were lost: nothing was
    written)."""
    path, char = _overflowing_later(run_dir, tmp_path, "the ")
    code, out, err = run("--checkpoint", str(path), "--prompt", "the ", "--max-new-tokens", "20", *stream, *how)
    assert code == 2 and "Traceback" not in err
    samples = out.split(writing.SEPARATOR)
    assert len(samples) == (int(how[how.index("--num-samples") + 1]) if "--num-samples" in how else 1)
    for text in samples:
        assert text.startswith("the " + char) and text.endswith("\n") and len(text) <= len("the ") + 3
    assert err.endswith("parameters, step 200, vocabulary 35\nerror: the model's output stopped being a finite number "
                        "partway through the text (its weights are so large that float32 overflows); sample from "
                        "another checkpoint\n")  # one line after the checkpoint's: no blank one before it


HUGE = "9" * 4000


@pytest.mark.parametrize(("args", "fragment"), [
    (["--max-new-tokens", HUGE], "--max-new-tokens must be at most 10,000,000, got 9999...9999 (4,000 digits)"),
    (["--max-new-tokens", "-" + HUGE], "--max-new-tokens must be >= 0, got -9999...9999 (4,000 digits)"),
    (["--seed", HUGE], "--seed must fit in a signed 64-bit integer, got 9999...9999 (4,000 digits)"),
    (["--num-samples", "-" + HUGE], "--num-samples must be >= 1, got -9999...9999 (4,000 digits)"),
    (["--top-k", "-" + HUGE], "--top-k must be >= 1, got -9999...9999 (4,000 digits)"),
], ids=["max-new-tokens", "negative-max-new-tokens", "seed", "num-samples", "top-k"])
def test_a_huge_number_is_quoted_by_its_ends_and_its_length(run, args, fragment):
    line = one_error_line(run(*args))
    assert fragment in line and len(line) < 200, line[:300]


@pytest.mark.parametrize(("args", "fragment"), [
    (["--max-new-tokens", "9" * 5000], "invalid int value: '999"),  # past Python's 4,300 digits: not read as an int
    (["--temperature", "x" * 5000], "invalid float value: 'xxx"),
], ids=["5000-digits", "not-a-float"])
def test_a_huge_value_the_parser_refuses_is_quoted_by_its_ends(capsys, args, fragment):
    with pytest.raises(SystemExit) as exited:
        sample.main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.splitlines()) == 1
    assert fragment in err and "..." in err and len(err) < 200, err[:300]


@pytest.mark.parametrize(("args", "line"), [
    (["--temperature", "1e-400"], "error: argument --temperature: 1e-400 is too near 0 for a float (the least above 0 "
     "is about 5e-324), so it would be read as 0; write 0 if 0 is meant: --temperature 0 samples greedily (see "
     "sample.py --help)"),
    (["--temperature=-1e-400"], "error: argument --temperature: -1e-400 is too near 0 for a float (the least above 0 "
     "is about 5e-324), so it would be read as 0; write 0 if 0 is meant: --temperature 0 samples greedily (see "
     "sample.py --help)"),
    (["--top-p", "1e-400"], "error: argument --top-p: 1e-400 is too near 0 for a float (the least above 0 is about "
     "5e-324), so it would be read as 0; write 0 if 0 is meant (see sample.py --help)"),
], ids=["temperature", "negative-temperature", "top-p"])
def test_a_number_too_near_zero_for_a_float_is_refused_not_read_as_zero(capsys, args, line):
    # float() reads 1e-400 as 0: --temperature 1e-400 sampled greedily without a word (the characters any temperature
    # below about 1e-38 gives, but from a 0 nobody wrote), and --top-p 1e-400 was refused as "got 0.0"
    with pytest.raises(SystemExit) as exited:
        sample.main(args)
    assert exited.value.code == 2
    assert capsys.readouterr() == ("", line + "\n")


def test_a_prompt_with_unseen_characters_names_them(run):
    unseen = [c for c in "Zq\u20ac" if c not in SMALL_TEXT]
    assert len(unseen) == 3  # the premise: none of these is in the training text
    line = one_error_line(run("--prompt", "All: Zq\u20ac!"))
    for c in unseen:
        assert repr(c) in line
    assert "'A'" not in line and "':'" not in line  # the characters the model knows are not blamed


# ----------------------------------------------------------------------------------------- subprocess


@pytest.mark.slow
def test_a_real_sample_process_prints_only_the_samples(run, run_dir):
    args = ["--out-dir", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "25", "--num-samples", "2"]
    args += ["--seed", "21", "--device", "cpu"]
    result = subprocess.run(
        [sys.executable, "sample.py", *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # one thread, as in this process
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "parameters" in result.stderr
    # byte for byte what the in-process call prints: nothing else reaches stdout
    assert result.stdout == ok(run(*args))
    assert len(result.stdout) == 2 * (len(PROMPT) + 25 + 1) + len(writing.SEPARATOR)


def test_sampling_a_small_window_on_one_thread_gives_the_threads_back(run):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ok(run("--max-new-tokens", "5"))  # the module's model is far below SAMPLE_ONE_THREAD_MAX
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("where", ["loading the checkpoint", "drawing the attention map"])
def test_a_ctrl_c_before_sampling_is_one_line_and_status_130(run, monkeypatch, tmp_path, where):
    import lab.heatmap

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    if where == "loading the checkpoint":
        monkeypatch.setattr(request, "load_checkpoint", ctrl_c)
    else:
        monkeypatch.setattr(lab.heatmap, "attention_weights", ctrl_c)
    code, out, err = run("--prompt", PROMPT, "--attention-map", str(tmp_path / "map.png"))
    assert code == 130 and out == ""
    assert err.splitlines()[-1] == "interrupted (SIGINT); nothing was sampled" and "Traceback" not in err
    assert not (tmp_path / "map.png").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_ctrl_c_while_sampling_waits_for_the_character_and_a_second_one_does_not(signum):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with stops.ctrl_c_between_characters() as asked:
        assert asked() is None
        os.kill(os.getpid(), signum)  # handled at the next bytecode: only noted
        assert asked() == signum
        with pytest.raises(KeyboardInterrupt) as raised:
            os.kill(os.getpid(), signum)
    assert {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} == before  # as they were
    assert isinstance(raised.value, stops.Terminated) == (signum == signal.SIGTERM)
    assert stops.stopped(raised.value, "stopped sampling") == 128 + signum


def test_a_ctrl_c_while_the_samples_are_written_stops_the_writing(run, monkeypatch):
    """Once the characters were drawn, a Ctrl-C (or SIGTERM) was noted and never read again: the samples were written
    to the end and the program said nothing and exited 0, or with a pipe nobody read, stayed there."""

    class Stdout(io.StringIO):
        def write(self, text: str) -> int:
            if not self.getvalue():  # the first of the samples' writes (not streamed): the drawing is over
                os.kill(os.getpid(), signal.SIGINT)
            return super().write(text)

    out = Stdout()
    monkeypatch.setattr(sys, "stdout", out)
    code, _, err = run("--prompt", PROMPT, "--max-new-tokens", "50", "--num-samples", "3")
    assert code == 130 and err.splitlines()[-1] == "interrupted (SIGINT); stopped sampling", err
    assert out.getvalue().count(PROMPT) < 3  # stopped in the middle of the writing


def sample_process(run_dir: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "sample.py"), "--out-dir", str(run_dir), "--device", "cpu",
                           *args], timeout=120, check=False, **kwargs)


def test_stderr_open_only_for_reading_is_taken_for_a_closed_one(run_dir):
    # pyenv's shim, after `2>&-`, leaves descriptor 2 open on its script for reading: every message failed (EBADF)
    # and the samples were never written (exit status 1). Given as the process's stderr, not set up by a preexec_fn,
    # the descriptor reaches a process forked from tests/zygote.py's too (0.5 s of CPU, against 1.9 s exec'd)
    read_only = os.open(os.devnull, os.O_RDONLY)
    try:
        done = sample_process(run_dir, "--prompt", "the", "--max-new-tokens", "30", stdout=subprocess.PIPE, text=True,
                              stderr=read_only)
    finally:
        os.close(read_only)
    assert done.returncode == 0
    assert done.stdout.startswith("the") and len(done.stdout) == len("the") + 30 + 1


def test_stderr_open_only_for_reading_is_replaced_by_dev_null_for_writing():
    # The test above passes as long as either half works: sys.stderr's failed writes going quiet, or descriptor 2
    # itself replaced. The descriptor must be, for what libraries write to it in C (torch's warnings). No torch here.
    script = ("import fcntl, os; from training.streams import stderr_kept_open; stderr_kept_open(); "
              "st, null = os.fstat(2), os.stat(os.devnull); "
              "print(fcntl.fcntl(2, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY, "
              "(st.st_dev, st.st_ino) == (null.st_dev, null.st_ino))")
    read_only = os.open(os.devnull, os.O_RDONLY)
    try:
        done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              stderr=read_only, timeout=60, check=False)
    finally:
        os.close(read_only)
    assert (done.returncode, done.stdout) == (0, "True True\n")


def test_a_reader_of_stderr_that_goes_away_loses_nothing_else(run_dir, tmp_path):
    # `2>&1 >out.txt | head -c 5`: the checkpoint's line met a closed pipe, a BrokenPipeError ended the run with
    # status 1, and the samples bound for the file were never written
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the first message
    with open(tmp_path / "out.txt", "w") as out:
        done = sample_process(run_dir, "--prompt", "the", "--max-new-tokens", "30", stdout=out, stderr=write)
    os.close(write)
    assert done.returncode == 0
    assert (tmp_path / "out.txt").read_text(encoding="utf-8").startswith("the")
    read, write = os.pipe()
    os.close(read)
    refused = sample_process(run_dir, "--max-new-tokens", "-3", stdout=subprocess.DEVNULL, stderr=write)
    os.close(write)
    assert refused.returncode == 2  # the status of the refusal, not 1 for the lost message


def test_stdout_whose_encoding_cannot_hold_the_text_gets_it_in_utf8(tmp_path):
    # PYTHONIOENCODING=ascii, or Windows's cp1252 for `> out.txt`: the first character outside it was a
    # UnicodeEncodeError, a traceback, and every sample lost
    text = "h\u00e9llo w\u00f6rld \u65e5\u672c \U0001f600 " * 40
    import train

    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    run_dir = tmp_path / "out"
    overrides = tiny_overrides(tmp_path / "corpus.txt", run_dir, **{"train.max_iters": 5, "train.eval_interval": 5})
    assert train.main(["--config", str(ROOT / "configs" / "tiny.yaml"), *overrides], progress=False) == 0
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    for stream in ([], ["--stream"]):
        done = sample_process(run_dir, "--prompt", "h\u00e9", "--max-new-tokens", "40", *stream, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert done.returncode == 0, done.stderr
        out = done.stdout.decode("utf-8")
        assert out.startswith("h\u00e9") and len(out) == 2 + 40 + 1 and set(out[:-1]) <= set(text)


def test_a_value_that_starts_with_a_dash_is_shown_how_to_give_it(capsys):
    # argparse takes -ROMEO for an option and said only "expected one argument"
    def refusal(*argv: str) -> str:
        with pytest.raises(SystemExit) as exited:
            sample.parse_args(list(argv))
        assert exited.value.code == 2
        return capsys.readouterr().err

    assert refusal("--prompt", "-ROMEO") == (
        "error: argument --prompt: expected one argument; a value that starts with '-' goes after '=', as in "
        "--prompt=-ROMEO (see sample.py --help)\n")
    assert "as in --temperature=-1e-3 " in refusal("--temperature", "-1e-3")
    assert "as in '--prompt=-ROMEO!' " in refusal("--prompt", "-ROMEO!")  # a word the shell takes back whole
    assert refusal("--prompt") == "error: argument --prompt: expected one argument (see sample.py --help)\n"
    assert sample.parse_args(["--prompt=-ROMEO"]).prompt == "-ROMEO"
    # '--' after '=' (as the hint above would advise for a prompt of '--'): Python 3.11's argparse gave the option []
    # past its type and choices, a traceback or, for --out-dir, the default run sampled without a word
    args = sample.parse_args(["--prompt=--", "--out-dir=--"])
    assert args.prompt == "--" and args.out_dir == "--"
    assert "invalid int value: '--'" in refusal("--seed=--")
    assert "invalid choice: '--'" in refusal("--compile=--")


def test_a_damaged_best_pt_names_the_runs_other_checkpoint(run, run_dir, tmp_path):
    # "cannot read checkpoint '.../best.pt' (truncated or not a checkpoint): KeyError: 174812789", and no way on
    shutil.copy(run_dir / "ckpt.pt", tmp_path / "ckpt.pt")
    (tmp_path / "best.pt").write_text("junk\n", encoding="utf-8")
    assert one_error_line(run(out_dir=tmp_path)) == (
        f"error: cannot read checkpoint {quoted(tmp_path / 'best.pt')} (truncated or not a checkpoint): it is not a "
        f"whole file that torch.save wrote; the run's latest checkpoint may be whole: --checkpoint "
        f"{tmp_path / 'ckpt.pt'}")
    assert ok(run("--checkpoint", str(tmp_path / "ckpt.pt"), "--max-new-tokens", "5"))
    one_error_line(run("--checkpoint", str(tmp_path / "best.pt")))  # chosen by name: no other is offered
    assert "--checkpoint" not in one_error_line(run("--checkpoint", str(tmp_path / "best.pt")))
    # a best.pt that a later tinychar wrote is whole: the line says which tinychar reads it, and offers no other file
    payload = torch.load(run_dir / "ckpt.pt", weights_only=True)
    payload["version"] = VERSION + 1
    torch.save(payload, tmp_path / "best.pt")
    line = one_error_line(run(out_dir=tmp_path))
    assert line.endswith("load it with the tinychar that wrote it, or a later one") and "--checkpoint" not in line


def test_a_closed_stderr_keeps_the_messages_out_of_the_samples(run_dir):
    # Started with stderr closed (`2>&-`), Python leaves sys.stderr None, and print(file=None) writes to stdout: the
    # checkpoint's line went into the samples. Now the messages go to /dev/null and stdout holds only the text.
    done = subprocess.run([sys.executable, str(ROOT / "sample.py"), "--out-dir", str(run_dir), "--device", "cpu",
                           "--prompt", "the", "--max-new-tokens", "30"], stdout=subprocess.PIPE, text=True,
                          preexec_fn=lambda: os.close(2), timeout=120, check=False)
    assert done.returncode == 0
    assert done.stdout.startswith("the") and len(done.stdout) == len("the") + 30 + 1  # the text and its newline


def test_the_noise_drawn_ahead_of_the_compiled_loop_is_kept_to_a_bound():
    """200 samples of a 60,000-character vocabulary: 32 characters' noise was 1.5 GB, held twice by the compiled loop
    (a peak of 3.5 GB where 0.5 GB was counted; 400 samples, a traceback). Measured with the bound: 0.62 GB."""
    NOISE_BYTES, noise_chunk = writing.NOISE_BYTES, writing.noise_chunk  # noqa: N806 - the module's names

    assert noise_chunk(32, 1, 65, 0.8) == 32  # tiny Shakespeare: as before
    assert noise_chunk(32, 200, 60_000, 0.8) == 1 and noise_chunk(32, 400, 60_000, 0.8) == 1
    assert noise_chunk(32, 16, 60_000, 0.8) == 17  # 17 x 16 x 60,000 floats: 62 MiB, within the 64
    for samples, vocab in ((1, 65), (16, 1_000), (4, 60_000), (200, 60_000)):
        chunk = noise_chunk(32, samples, vocab, 0.8)
        assert 1 <= chunk <= 32 and (chunk == 1 or chunk * samples * vocab * 4 <= NOISE_BYTES)
    assert noise_chunk(32, 400, 60_000, 0.0) == 32  # greedy draws no noise


def test_a_library_an_interrupted_compile_left_empty_in_the_cache_is_removed_and_the_sampler_compiled_again(
        run, monkeypatch, tmp_path):
    """An empty main.so left in the compile cache by a Ctrl-C while inductor built the sampler made every compiled
    sample say "cannot compile here (InductorError: ImportError: .../main.so: file too short); sampling eagerly", for
    good. It is removed and the sampler compiled again: the same characters. Staged: torch.compile runs the step as it
    is, and the warm-up loads the file, by the real loader, while it is there."""
    from test_training_engine import load_compiled_module

    from model import sampler

    args = ("--prompt", PROMPT, "--max-new-tokens", "40", "--num-samples", "2", "--seed", "5")
    expected = ok(run(*args, "--compile", "false"))
    monkeypatch.setattr(writing.compile_cache, "_USER_CACHE", str(tmp_path))
    library = writing.compile_cache.cache_folder() / "ef" / "main.so"
    library.parent.mkdir(parents=True)
    library.touch()
    monkeypatch.setattr(writing.compile_cache, "prepare_compile", lambda: library.parent.parent)
    monkeypatch.setattr(writing.step_file, "used_on", lambda device: False)
    monkeypatch.setattr(sampler.torch, "compile", lambda fn, **kwargs: fn)
    warm_up = writing.WindowSampler.warm_up

    def loading(self, batch, device):
        if library.exists():
            load_compiled_module(library)
        warm_up(self, batch, device)

    monkeypatch.setattr(writing.WindowSampler, "warm_up", loading)
    code, out, err = run(*args, "--compile", "true")
    assert code == 0 and out == expected and not library.exists()
    assert (f"compile cache: '{library}' in it could not be loaded (file too short), left over from an interrupted "
            f"compile: it was removed, and is compiled again") in err
    assert "sampling step compiled in" in err and "eagerly" not in err, err


def test_a_prompt_for_a_model_that_kept_u_fffd_in_place_of_rare_characters_is_told_so():
    """A model trained with data.max_vocab saw its rarest characters as U+FFFD: 'never saw' alone hid the one it has."""
    with pytest.raises(request.UsageError) as e:
        request.check_known("café", {c: i for i, c in enumerate("acef\ufffd")})
    assert str(e.value) == ("the prompt holds characters the model never saw in training: 'é'; remove or replace them "
                            "(this model's vocabulary holds U+FFFD, which stood in for the characters its training "
                            "text did not keep: U+FFFD may stand in for them here too)")
    with pytest.raises(request.UsageError) as e:
        request.check_known("café", {c: i for i, c in enumerate("acef")})
    assert str(e.value).endswith("'é'; remove or replace them")
