"""Sorting digits with attention: the GRU sorter learns, looks where the digits are, and the bottleneck shows."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image

import lab.sort
from configs.userinput import shell_word, shown
from lab.__main__ import main as lab_main
from lab.sort import SortConfig, held_out, main, memory_need, new_model, run, sorting_batch, train
from lab.sort_task import evaluate

ROOT = Path(__file__).resolve().parents[1]

# Measured on 2026-11-23 (2-core AMD EPYC, one thread): 400 steps of 128 train in 9.5 s to 99.7% exact-sequence
# accuracy, and the strongest cell of 97.8% of the heatmap's rows holds the digit that row outputs. 250 steps at lr
# 5e-3, measured on 2026-12-06 (2-core AMD EPYC (Zen 2, AVX2), one thread): 99.6% and 97.1% in 8.0 s of CPU against
# 13.4 s, and 99.7/97.1% and 99.6/97.1% with seeds 1 and 2 (200 steps at 6e-3: 99.5/96.0%, 99.3/95.8%, 99.4/96.7%,
# too near the second bar).
GRU_LENGTH_8 = SortConfig(steps=250, learning_rate=5e-3, eval_size=1000)


@pytest.fixture(scope="module")
def trained_gru():
    return run(GRU_LENGTH_8)


def test_batches_are_sorted_copies_and_reproducible():
    a = sorting_batch(4, 6, 10, torch.Generator().manual_seed(3))
    b = sorting_batch(4, 6, 10, torch.Generator().manual_seed(3))
    assert torch.equal(a.src, b.src)
    assert torch.equal(a.tgt, a.src.sort(-1).values)
    assert torch.all(a.tgt_in[:, 0] == 10) and torch.equal(a.tgt_in[:, 1:], a.tgt[:, :-1])  # start, then shifted


def test_training_is_deterministic():
    cfg = SortConfig(steps=3, batch_size=8, n_embd=8)
    assert train(new_model(cfg), cfg) == train(new_model(cfg), cfg)


def test_training_steps_as_torchs_adam_to_the_bit_without_importing_torchs_compiler(monkeypatch, tmp_path):
    # tinychar's AdamW without weight decay stands in for torch.optim.Adam, whose first step imported torch's compiler:
    # 1.35 s of every `python -m lab sort` (3.56 -> 2.19 s for 20 steps on a 2-core Zen 3, 2026-12-05)
    cfg = SortConfig(steps=20, batch_size=16, n_embd=16)
    torch.manual_seed(0)
    ours = new_model(cfg)
    our_losses = train(ours, cfg)
    monkeypatch.setattr(lab.sort, "AdamW", lambda params, lr, weight_decay: torch.optim.Adam(params, lr=lr),
                        raising=False)
    torch.manual_seed(0)
    theirs = new_model(cfg)
    assert train(theirs, cfg) == our_losses
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values(), strict=True))
    code = ("import sys; import lab.sort as s; s.main(['--steps', '3', '--batch-size', '8', '--heatmap', sys.argv[1]])"
            "; print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "map.png")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False", done.stdout


@pytest.mark.slow
def test_gru_with_attention_sorts_length_8(trained_gru):
    assert trained_gru.accuracy >= 0.99


@pytest.mark.slow
def test_each_output_looks_at_where_its_digit_sits(trained_gru):
    batch = held_out(GRU_LENGTH_8)
    _, weights = evaluate(trained_gru.model, batch)  # (B, T_out, T_in)
    looked_at = torch.gather(batch.src, 1, weights.argmax(dim=-1))  # the input digit under each row's strongest cell
    assert (looked_at == batch.tgt).float().mean().item() >= 0.95


@pytest.mark.slow
def test_without_attention_length_12_is_measurably_worse():
    # With 40 symbols the final encoder state must hold 12 of 40 values; with attention the decoder looks them up.
    # Measured on 2026-11-25 (2-core AMD EPYC, one thread): 24% exact with attention (5.5 s), 0.7% without (2.5 s)
    # at 160 steps of 128 (lr 3e-3); at length 16 of 50 symbols, 200 steps: 29% and 0% in 14 s and 5 s. Half the
    # batch, 100 steps at lr 1e-2 (the same budget for both), measured on 2026-12-05 (2-core AMD EPYC (Zen 3, AVX2),
    # one thread): 34.0% with attention, 2.7% without, in 2.7 s and 1.4 s of CPU (160 steps of 128: 7.9 s and 3.5 s);
    # seeds 1 and 2: 32.7/3.7% and 33.0/3.7%. Exact-sequence accuracy is steep: 80 steps made 13.3/0.7%.
    cfg = SortConfig(length=12, digits=40, steps=100, batch_size=64, learning_rate=1e-2, eval_size=300)
    with_attention = run(cfg).accuracy
    without = run(replace(cfg, attention=False)).accuracy
    assert with_attention >= 0.10 and without <= with_attention - 0.10


def test_heatmap_png_is_written(tmp_path, capsys):
    path = tmp_path / "maps" / "gru.png"
    assert main(["--steps", "2", "--batch-size", "8", "--heatmap", str(path)]) == 0
    out = capsys.readouterr().out
    assert "exact-sequence accuracy" in out and str(path) in out
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width > 100 and image.height > 100


def test_ctrl_c_while_training_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(lab.sort, "train", interrupted)  # was a traceback of some thirty lines
    assert main(["--steps", "2", "--batch-size", "8", "--heatmap", str(tmp_path / "map.png")]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "interrupted (SIGINT); stopped sorting" and not list(tmp_path.iterdir())


@pytest.mark.parametrize(("signum", "status"), [(15, 143), (2, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_while_training_or_checking_is_one_line_and_its_status(signum, status, tmp_path, capsys,
                                                                             monkeypatch, request):
    # SIGTERM ended the run without a word; a Ctrl-C while TensorBoard loaded, before training, was a traceback
    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signum)  # as the signal would come, in the middle of the work
        pytest.fail("the signal did not stop the work")

    def unhandled(signum, frame):  # what a signal main does not handle would do, without ending pytest
        pytest.fail(f"signal {signum} was not handled")

    previous = signal.signal(signal.SIGTERM, unhandled)
    request.addfinalizer(lambda: signal.signal(signal.SIGTERM, previous))
    monkeypatch.setattr(lab.sort, "train", signalled)
    assert main(["--steps", "2", "--batch-size", "8", "--heatmap", str(tmp_path / "map.png")]) == status
    name = {15: "SIGTERM", 2: "SIGINT"}[signum]
    assert capsys.readouterr().err == f"\ninterrupted ({name}); stopped sorting\n" and not list(tmp_path.iterdir())
    monkeypatch.setattr(lab.sort, "tensorboard_writer", signalled)
    try:
        code = main(["--steps", "2", "--logdir", str(tmp_path / "logs"), "--heatmap", str(tmp_path / "map.png")])
    except KeyboardInterrupt:  # a failure of this test, not a Ctrl-C of the session
        pytest.fail("the Ctrl-C came out of main as a KeyboardInterrupt")
    assert code == status
    assert capsys.readouterr().err == f"\ninterrupted ({name}); stopped sorting\n" and not list(tmp_path.iterdir())


def test_no_attention_has_no_heatmap(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--no-attention", "--steps", "2", "--batch-size", "8"]) == 0
    assert "heatmap" not in capsys.readouterr().out and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "lstm"],
        ["--score", "cosine"],
        ["--length", "0"],
        ["--digits", "1"],
        ["--steps", "many"],
        ["--model", "transformer", "--no-attention"],
        ["--bottleneck", "--lengths", "8", "0"],
        ["--frobnicate"],
        ["--lr", "inf"],
        ["--lr", "nan"],
        ["--lr", "0"],
    ],
)
def test_bad_options_are_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_unknown_command_is_one_line_and_exit_2(capsys):
    assert lab_main(["shuffle"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'shuffle'" in err and err.count("\n") == 1


@pytest.mark.parametrize(("command", "said"), [("sort\nx", "'sort\\nx'"), ("\x1b[2Jred", "'\\x1b[2Jred'"),
                                               ("x" * 10_000, "'xxxxxxxxxxxxxxxxxxxxxxxxxx...")],
                         ids=["newline", "escape", "10,000 characters"])
def test_an_unknown_command_is_quoted_escaped_and_cut(command, said, capsys):
    # It was quoted raw: a newline split the line, a terminal's escape acted on the screen, 10,000 characters came back
    assert lab_main([command]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: unknown command {said}") and err.count("\n") == 1 and len(err) < 300, err


@pytest.mark.parametrize("reader", ["closed early", "a full disk"])
def test_the_lab_help_to_a_stdout_that_goes_away_or_fills_up_is_not_a_traceback(reader):
    command = [sys.executable, "-m", "lab", "--help"]
    env = {**os.environ, "PYTHONUNBUFFERED": ""}  # the flush at exit, or each print, failed in a traceback
    if reader == "a full disk":
        with open("/dev/full", "w") as full:
            done = subprocess.run(command, cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True, timeout=60,
                                  env=env)
        assert done.returncode == 1 and done.stderr == "error: cannot write to stdout (No space left on device)\n"
        return
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    child.stdout.close()
    assert child.wait(timeout=60) == 0 and child.stderr.read() == ""


def test_ctrl_c_while_the_lab_loads_is_one_line_and_status_130(monkeypatch, capsys):
    """A Ctrl-C while `python -m lab sort` imports torch and the models (seconds) was a KeyboardInterrupt traceback
    from inside an import; it now waits for the imports, then ends in one line."""
    import importlib.abc
    import os
    import signal

    import lab

    class Interrupting(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "lab.sort":
                os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C would, in the middle of the import
            return None

    monkeypatch.delattr(lab, "sort")  # both put back afterwards: the import below makes the module afresh
    monkeypatch.delitem(sys.modules, "lab.sort")
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    # Python's own handler, or SIG_IGN where pytest was started in the background of a shell (`pytest &`): restored
    before = signal.getsignal(signal.SIGINT)
    try:
        code = lab_main(["sort", "--steps", "1"])
    except KeyboardInterrupt:  # a failure of this test, not a Ctrl-C of the session
        pytest.fail("the Ctrl-C came out of the import as a KeyboardInterrupt")
    assert code == 130
    assert capsys.readouterr().err == "interrupted (SIGINT) while starting; nothing was done\n"
    assert signal.getsignal(signal.SIGINT) is before


def test_sigterm_while_the_lab_loads_is_one_line_and_status_143(monkeypatch, capsys, request):
    """SIGTERM while `python -m lab sort` imports torch ended it without a word; it now waits for the imports, as
    Ctrl-C does, then ends in one line."""
    import importlib.abc

    import lab

    class Terminating(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "lab.sort":
                os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, in the middle of the import
            return None

    def unhandled(signum, frame):  # what the signal would do unhandled, without ending pytest
        pytest.fail("SIGTERM was not held while the lab loads")

    previous = signal.signal(signal.SIGTERM, unhandled)
    request.addfinalizer(lambda: signal.signal(signal.SIGTERM, previous))
    monkeypatch.delattr(lab, "sort")  # both put back afterwards: the import below makes the module afresh
    monkeypatch.delitem(sys.modules, "lab.sort")
    monkeypatch.setattr(sys, "meta_path", [Terminating(), *sys.meta_path])
    assert lab_main(["sort", "--steps", "1"]) == 143
    assert capsys.readouterr().err == "interrupted (SIGTERM) while starting; nothing was done\n"
    assert signal.getsignal(signal.SIGTERM) is unhandled


def no_training(*args, **kwargs):
    pytest.fail("training started")


def refused_before_training(argv: list[str], monkeypatch, capsys) -> str:
    """The one error line main(argv) exits 2 with, failing the test if it starts training first."""
    monkeypatch.setattr(lab.sort, "run", no_training)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("where, says", [("file/map.png", "is a file, not a folder"),
                                         ("file/sub/map.png", "is a file, not a folder"),
                                         ("folder", "it is a folder"),
                                         pytest.param("x" * 300 + ".png", "File name too long", id="long-name"),
                                         pytest.param("x" * 300 + "/map.png", "File name too long",
                                                      id="long-folder-name"),  # these two were a traceback
                                         # no new file, root's included (refused after training as root)
                                         pytest.param("/proc/map.png", "the folder '/proc' cannot be written",
                                                      id="proc"),
                                         # Pillow wrote the name into an ASCII header, and failed, after training
                                         pytest.param("é.im", "'.im' is a format Pillow is dropping", id="im")])
def test_an_unwritable_heatmap_is_one_line_and_exit_2_before_training(tmp_path, capsys, monkeypatch, where, says):
    (tmp_path / "file").write_text("")
    (tmp_path / "folder").mkdir()
    err = refused_before_training(["--steps", "1", "--heatmap", str(tmp_path / where)], monkeypatch, capsys)
    assert err.startswith(f"error: --heatmap: cannot write the heatmap '{shown(str(tmp_path / where))}'"), err
    assert says in err


def test_a_heatmap_onto_the_file_stdout_goes_to_is_one_line_and_exit_2_before_training(tmp_path, capsys, monkeypatch):
    # `lab sort --heatmap /dev/stdout > results.txt` trained, then wrote the picture over results.txt (the shell's
    # empty file passed for one a picture may replace) and printed the results into the old, unlinked file
    saved = os.dup(1)
    with open(tmp_path / "results.txt", "wb") as results:
        os.dup2(results.fileno(), 1)
    try:
        err = refused_before_training(["--steps", "1", "--heatmap", "/dev/stdout"], monkeypatch, capsys)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert err.startswith("error: --heatmap: cannot write the heatmap '/dev/stdout': it is where this command's "
                          "output (stdout) is written"), err
    assert (tmp_path / "results.txt").read_bytes() == b""


def test_a_heatmap_whose_name_is_near_the_systems_limit_is_written(tmp_path, capsys):
    # Its temporary file, '.<name>.<pid>.part', was past the 255 bytes a name may have: refused after training
    path = tmp_path / ("é" * 123 + ".png")  # 250 bytes
    assert main(["--steps", "1", "--batch-size", "4", "--heatmap", str(path)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert f"heatmap: {shell_word(str(path))}" in capsys.readouterr().out


def test_the_heatmap_and_tensorboard_lines_stay_one_line_each_whatever_the_names_hold(tmp_path, capsys):
    # a newline in a folder's name split each line in two, the second half a line of its own
    folder = tmp_path / "runs\nof today"
    folder.mkdir()
    path, logdir = folder / "map.png", folder / "logs"
    assert main(["--steps", "1", "--batch-size", "4", "--heatmap", str(path), "--logdir", str(logdir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"heatmap: $'{tmp_path}/runs\\nof today/map.png'" in lines
    assert f"TensorBoard: $'{tmp_path}/runs\\nof today/logs'" in lines
    assert path.exists() and any(logdir.iterdir())


def test_a_run_without_attention_draws_no_heatmap(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--steps", "1", "--batch-size", "4", "--no-attention"]) == 0
    assert "heatmap" not in capsys.readouterr().out and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("argv", "says"), [
    (["--bottleneck", "--model", "transformer"], "--bottleneck compares the GRU with and without attention; leave out "
                                                 "--model transformer"),
    (["--bottleneck", "--no-attention"], "leave out --no-attention"),
    (["--bottleneck", "--length", "4"], "--bottleneck takes its lengths from --lengths; leave out --length"),
    (["--bottleneck", "--heatmap", "x.png"], "--bottleneck prints a table and draws no heatmap; leave out --heatmap"),
    (["--bottleneck", "--logdir", "logs"], "leave out --logdir"),
    (["--lengths", "3", "4"], "--lengths is for --bottleneck's table; give one run its length with --length"),
    (["--model", "transformer", "--score", "dot"], "--score is the GRU's attention score"),
    (["--no-attention", "--score", "dot"], "--score scores the GRU's attention, which --no-attention leaves out"),
    (["--no-attention", "--heatmap", "x.png"], "--no-attention has no attention to draw a heatmap of"),
    (["--logdir", ""], "--logdir is empty"),
    (["--heatmap", ""], "--heatmap is empty"),
    (["--seed", str(2**64)], "--seed must fit in a signed 64-bit integer, got 18446744073709551616"),
    (["--seed", str(-(2**63) - 1)], "--seed must fit in a signed 64-bit integer"),
    (["--lr", "1e39"], "--lr must be at most float32's largest number"),
    (["--steps", str(10**12)], "--steps must be at most 100,000"),  # it trained on for weeks
    (["--batch-size", "1" + "0" * 400], "--batch-size must be at most 2**63 - 1, got 1.000e+400"),  # an OverflowError
    (["--length", "1" + "0" * 400], "--length must be at most 2**63 - 1"),
    (["--digits", "1" + "0" * 400], "--digits must be at most 2**63 - 1"),
    (["--digits", "1"], "error: --digits must be at least 2, got 1 "),  # the option, not SortConfig's field
    (["--lr", "-1"], "error: --lr must be a finite number > 0, got -1.0 "),
    # float() reads 1e-400 as 0: it was refused as "got 0.0", a number not given
    (["--lr", "1e-400"], "error: argument --lr: 1e-400 is too near 0 for a float (the least above 0 is about 5e-324)"),
    (["--batch-size", "0"], "error: --batch-size must be at least 1, got 0 "),
    # quoted whole, 4,000 digits (a 440-character line); now by its power of ten, as sample.py and train.py do
    (["--steps", "9" * 4000], "take seconds), got 9.999e+3999 (see"),
    (["--steps", "-" + "9" * 4000], "error: --steps must be at least 1, got -9.999e+3999 "),
    (["--seed", "9" * 4000], "error: --seed must fit in a signed 64-bit integer, got 9.999e+3999 "),
])
def test_options_the_run_would_ignore_or_cannot_take_are_one_line_before_training(argv, says, capsys, monkeypatch,
                                                                                   tmp_path):
    # Each was ignored without a word (a GRU measured where a transformer was asked for, an empty --logdir taken as
    # TensorBoard's default folder), or a traceback (a seed or learning rate that overflows inside torch).
    monkeypatch.chdir(tmp_path)
    err = refused_before_training(["--steps", "1", *argv], monkeypatch, capsys)
    assert says in err and len(err) < 200
    assert list(tmp_path.iterdir()) == []


def test_the_largest_seed_runs_its_held_out_seed_wrapping_around(tmp_path):
    cfg = SortConfig(seed=2**63 - 1)
    assert cfg.held_out_seed() == -(2**63) and SortConfig(seed=5).held_out_seed() == 6
    argv = ["--steps", "1", "--batch-size", "4", "--seed", str(2**63 - 1), "--heatmap", str(tmp_path / "h.png")]
    assert main(argv) == 0  # it trained, then failed in held_out with an overflow


def test_the_heatmap_is_written_in_its_names_format_and_never_over_a_file_that_is_not_a_picture(tmp_path, capsys,
                                                                                                monkeypatch):
    # It was PNG bytes whatever the name (a .jpg, a .txt, a checkpoint's best.pt), written straight over the path.
    (tmp_path / "model").write_bytes(b"PK\x03\x04 a checkpoint without an extension")
    err = refused_before_training(["--steps", "1", "--heatmap", str(tmp_path / "model")], monkeypatch, capsys)
    assert "a file that is not a picture is there" in err
    assert (tmp_path / "model").read_bytes() == b"PK\x03\x04 a checkpoint without an extension"
    err = refused_before_training(["--steps", "1", "--heatmap", str(tmp_path / "best.pt")], monkeypatch, capsys)
    assert "Pillow cannot write '.pt' pictures" in err
    monkeypatch.undo()
    assert main(["--steps", "1", "--batch-size", "4", "--heatmap", str(tmp_path / "h.jpg")]) == 0
    with Image.open(tmp_path / "h.jpg") as image:
        assert image.format == "JPEG"


@pytest.mark.parametrize("reader", ["closed early", "a full disk"])
def test_a_stdout_that_goes_away_or_fills_up_is_not_a_traceback(tmp_path, reader):
    command = [sys.executable, "-m", "lab", "sort", "--steps", "1", "--batch-size", "4", "--heatmap",
               str(tmp_path / "h.png")]
    if reader == "a full disk":
        with open("/dev/full", "w") as full:
            done = subprocess.run(command, cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
        assert done.returncode == 1 and done.stderr == "error: cannot write to stdout (No space left on device)\n"
        return
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child.stdout.close()  # as `| head -c 0` does: the results have no reader
    assert child.wait(timeout=120) == 0
    assert child.stderr.read() == ""


def test_a_heatmap_that_cannot_be_written_after_training_is_still_one_line(tmp_path, capsys, monkeypatch):
    def failing(image, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(lab.sort, "write_picture", failing)
    assert main(["--steps", "1", "--batch-size", "4", "--heatmap", str(tmp_path / "map.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write the heatmap") and err.count("\n") == 1


def test_a_closed_stdout_is_one_line_and_exit_2_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdout", None)  # `>&-`: the run trained, then its flush of stdout was a traceback
    err = refused_before_training(["--steps", "1", "--heatmap", str(tmp_path / "map.png")], monkeypatch, capsys)
    assert err.startswith("error: stdout is closed") and not list(tmp_path.iterdir())


@pytest.mark.parametrize("under", ["file", "file/sub"])
def test_an_unusable_logdir_is_one_line_and_exit_2_before_training(tmp_path, capsys, monkeypatch, under):
    (tmp_path / "file").write_text("")
    err = refused_before_training(["--steps", "1", "--logdir", str(tmp_path / under)], monkeypatch, capsys)
    assert err.startswith(f"error: --logdir: cannot write TensorBoard logs into '{shown(str(tmp_path / under))}'"), err
    if under == "file":  # it said "(File exists)"
        assert "(it is a file, not a folder); give a folder that can be created and written" in err


def test_a_logdir_that_is_there_but_cannot_be_written_is_one_line_before_training(tmp_path, capsys, monkeypatch):
    # SummaryWriter took it, and its writer thread failed on its own: a traceback beside the refusal, whose path was
    # quoted as bytes ('b'.../events.out.tfevents...'')
    logs = tmp_path / "logs"
    logs.mkdir()
    logs.chmod(0o555)
    real_access = os.access  # as root, os.access allows everything: what a user without the right sees
    monkeypatch.setattr(os, "access", lambda p, mode: not (Path(p) == logs and mode & os.W_OK) and real_access(p, mode))
    try:
        err = refused_before_training(["--steps", "1", "--heatmap", str(tmp_path / "h.png"), "--logdir", str(logs)],
                                      monkeypatch, capsys)
    finally:
        logs.chmod(0o755)
    assert err == (f"error: --logdir: cannot write TensorBoard logs into '{shown(str(logs))}' (the folder cannot be "
                   f"written); give a folder that can be created and written (see python -m lab sort --help)\n")
    assert list(logs.iterdir()) == []


@pytest.mark.parametrize("argv", [["--batch-size", "100000000"], ["--length", "10000000"], ["--digits", "1000000000"],
                                  ["--model", "transformer", "--length", "5000"],
                                  ["--bottleneck", "--lengths", "8", "100000"]])
def test_a_run_too_big_for_the_memory_is_refused_in_one_line_before_allocating(argv, capsys, monkeypatch):
    monkeypatch.setattr(lab.sort, "allocatable_bytes", lambda device: 8 * 10**9)
    err = refused_before_training(["--steps", "1", *argv], monkeypatch, capsys)
    option = "--lengths" if "--bottleneck" in argv else "--length"  # the option the user gave, not the one refused
    assert err.startswith(f"error: a run of {option} ") and "GB of memory and this machine has 8.0 GB free" in err


@pytest.mark.parametrize("lengths", [["0", "8"], ["8", str(2**63)]])
def test_a_length_of_bottleneck_s_table_out_of_range_names_lengths(lengths, capsys):
    # 2**63 was refused as "length must be at most 2**63 - 1", naming no option the user could find
    with pytest.raises(SystemExit) as e:
        main(["--bottleneck", "--lengths", *lengths])
    assert e.value.code == 2
    bad = lengths[0] if lengths[0] == "0" else lengths[1]
    assert capsys.readouterr().err == (f"error: --lengths must be from 1 to 2**63 - 1, got {bad} (see python -m lab "
                                       f"sort --help)\n")


def test_a_run_past_the_process_s_memory_limit_names_the_limit_not_the_machine(capsys, monkeypatch):
    """Under ulimit -v the refusal said "this machine has 1.4 GB free" on a machine with 24 GB free."""
    import training.memory

    monkeypatch.setattr(training.memory, "available_bytes", lambda device: 24 * 10**9)
    monkeypatch.setattr(training.memory, "process_limit_available", lambda: 10**9)
    err = refused_before_training(["--steps", "1", "--batch-size", "512", "--length", "64"], monkeypatch, capsys)
    assert ("GB of memory and this process's memory limit (ulimit -v or -d) leaves 1.0 GB free; make them "
            "smaller") in err


def test_the_memory_estimate_lets_the_documented_runs_through_and_grows_with_every_size():
    documented = [SortConfig(), SortConfig(score="dot"), SortConfig(model="transformer", learning_rate=1e-3),
                  SortConfig(digits=50, length=16), SortConfig(digits=50, length=16, attention=False)]
    assert max(memory_need(cfg) for cfg in documented) < 500 * 10**6  # any machine that runs torch has that
    base = memory_need(SortConfig())
    for bigger in ({"batch_size": 256}, {"length": 16}, {"digits": 20}, {"n_embd": 128}):
        assert memory_need(SortConfig(**bigger)) > base, bigger


def test_the_memory_estimate_counts_the_transformers_greedy_logits():
    # --model transformer --digits 8000 --length 32 --batch-size 1 peaked at 5.2 GB (torch's own few hundred MB
    # among them) where the estimate said 0.58 GB; --digits 100000 --length 64 (51 GB of logits) would have run
    assert memory_need(SortConfig(model="transformer", digits=8000, length=32, batch_size=1)) > 4.4e9
    assert memory_need(SortConfig(model="transformer", digits=100_000, length=64, batch_size=1)) > 51e9


def test_the_memory_estimate_counts_the_grus_greedy_logits_twice():
    # --digits 200000 --length 8 --batch-size 1 --steps 1 peaked at 3.90 GB (torch's own few hundred MB among them)
    # where the estimate said 2.31 GB: a traceback under a 4 GB limit, after the check let it through
    assert memory_need(SortConfig(digits=200_000, length=8, batch_size=1, steps=1)) > 3.6e9


@pytest.mark.parametrize(("batch", "length", "peak"), [(20_000, 8, 2.22e9), (40_000, 8, 4.14e9), (80_000, 8, 7.75e9),
                                                      (10_000, 16, 2.29e9), (5_000, 32, 2.29e9), (2_000, 64, 2.47e9)])
def test_the_memory_estimate_is_above_what_a_transformer_keeps_for_its_backward_pass(batch, length, peak):
    # peak memory of `python -m lab sort --model transformer --steps 1` (2026-12-02, torch 2.13), where the estimate
    # said 1.1, 2.0 and 3.9 GB for the first three: under `ulimit -v 2000000` --batch-size 20,000 was an allocator
    # traceback instead of the refusal. torch's own 0.48 GB (the peak at --batch-size 100) is left out of the estimate.
    assert memory_need(SortConfig(model="transformer", batch_size=batch, length=length)) > peak - 0.48e9


def test_the_real_command_refuses_bad_options_in_one_line():
    done = subprocess.run([sys.executable, "-m", "lab", "sort", "--score", "cosine"], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "--score must be one of additive, dot" in done.stderr


def test_tensorboard_gets_the_held_out_accuracy_and_the_heatmap(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lab.heatmap import render_attention_map
    from lab.sort import SortResult, log_result, tensorboard_writer

    cfg = SortConfig(steps=3)
    weights = torch.softmax(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), dim=-1)
    image = render_attention_map(weights, list("31415926"), list("11234569"))
    result = SortResult(model=new_model(cfg), accuracy=0.75, seconds=1.0, example=torch.arange(8), weights=weights,
                        answer=torch.arange(8))
    log_result(tensorboard_writer(str(tmp_path)), result, image, cfg)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("accuracy/held_out")] == [(3, 0.75)]
    (logged,) = events.Images("attention/decoder_over_encoder")
    assert (logged.step, logged.width, logged.height) == (3, image.width, image.height)


def test_a_full_disk_under_the_tensorboard_logs_is_one_line_about_them(tmp_path, capsys, monkeypatch):
    # the writer's failure was taken for stdout's: "cannot write to stdout", and stdout given up
    import errno

    from training.events import EventWriter

    real_write = EventWriter._write
    writes = []

    def write(self, data):  # the first event (the file's version) fits; then the disk is full
        writes.append(len(data))
        if len(writes) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(EventWriter, "_write", write)
    logs = tmp_path / "logs"
    code = main(["--steps", "20", "--batch-size", "8", "--logdir", str(logs), "--heatmap", str(tmp_path / "map.png")])
    err = capsys.readouterr().err
    assert code == 1
    assert err == (f"error: cannot write TensorBoard logs into '{shown(logs)}' (No space left on device); give "
                   f"--logdir a folder with room, or leave it out\n")


# Interrupts the first import of torch, as a Ctrl-C 0.6 s after the start did: loaded by Python at its start from
# PYTHONPATH, before the command's own code
INTERRUPT_TORCH_IMPORT = '''
import importlib.abc, os, signal, sys

class Interrupting(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Interrupting())
'''


@pytest.mark.parametrize("command", [["lab/sort.py"], ["-m", "lab.sort"], ["lab/walkthrough.py"],
                                     ["-m", "lab.walkthrough"]], ids=" ".join)
def test_a_lab_command_run_as_its_file_or_module_is_stopped_while_starting_in_one_line(command, tmp_path):
    # It skipped python -m lab's startup: a KeyboardInterrupt traceback from inside torch's import
    (tmp_path / "sitecustomize.py").write_text(INTERRUPT_TORCH_IMPORT)
    done = subprocess.run([sys.executable, *command, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert (done.returncode, done.stderr) == (130, "interrupted (SIGINT) while starting; nothing was done\n")
    assert done.stdout == ""


@pytest.mark.parametrize("command", [["lab/sort.py"]], ids=" ".join)
def test_a_heatmap_name_stdout_cannot_encode_is_written_and_said_when_run_as_a_file(command, tmp_path):
    # PYTHONIOENCODING=latin-1 python lab/sort.py --heatmap .../中.png: a UnicodeEncodeError traceback, exit 1. Run
    # as the file only: python -m lab.sort runs the same __main__ block into lab_main, which makes stdout take any
    # text once its start is over, whatever the way in; that -m lab.sort goes through that start, the test of a stop
    # while starting checks. A second run here (3.4 s of CPU: torch, and its compiler for the optimiser) checked the
    # same block again.
    path = tmp_path / "中.png"
    done = subprocess.run([sys.executable, *command, "--steps", "1", "--batch-size", "4", "--heatmap", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONIOENCODING": "latin-1"}, encoding="latin-1")
    assert (done.returncode, done.stderr) == (0, "")
    assert path.exists() and "heatmap: " in done.stdout


def test_a_tilde_after_an_options_equals_sign_is_the_home_folder(tmp_path, capsys, monkeypatch):
    # --heatmap=~/s.png and --logdir=~/tb, whose '~' the shell leaves alone, made a folder named '~' where the run was
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert main(["--steps", "1", "--batch-size", "4", "--heatmap=~/maps/s.png", "--logdir=~/tb"]) == 0
    assert list(work.iterdir()) == []
    assert (home / "maps" / "s.png").is_file() and any((home / "tb").iterdir())
    lines = capsys.readouterr().out.splitlines()
    assert f"heatmap: {home}/maps/s.png" in lines and f"TensorBoard: {home}/tb" in lines


@pytest.mark.parametrize(("logdir", "says"), [
    ("D/h.png", "--heatmap and --logdir name the same path"),
    ("D/h.png/logs", "--logdir is inside --heatmap's path, '"),
    ("D/./h.png/../h.png/tb/logs", "--logdir is inside --heatmap's path"),
])
def test_a_logdir_at_the_heatmaps_path_or_under_it_is_refused_before_training(logdir, says, tmp_path, capsys,
                                                                             monkeypatch):
    # the logs' folder was made there, and the heatmap refused after training for the folder in its way
    err = refused_before_training(["--steps", "1", "--heatmap", str(tmp_path / "D/h.png"), "--logdir",
                                   str(tmp_path / logdir)], monkeypatch, capsys)
    assert err.startswith(f"error: {says}") and list(tmp_path.iterdir()) == []


def test_a_heatmap_inside_the_logdir_is_written_there(tmp_path, capsys):
    logs = tmp_path / "logs"
    assert main(["--steps", "1", "--batch-size", "4", "--heatmap", str(logs / "h.png"), "--logdir", str(logs)]) == 0
    assert (logs / "h.png").is_file() and any(p.name.startswith("events.out.tfevents.") for p in logs.iterdir())


@pytest.mark.parametrize(("argv", "says"), [
    (["--lengths", "8", "16", "8"], "error: --lengths names 8 twice; give each length once"),
    # 5,000 lengths x 2 runs x 100,000 steps ran on
    (["--steps", "100000", "--lengths", *map(str, range(1, 5001))], "error: --lengths and --steps ask for 5,000 "
     "lengths x 2 runs x 100,000 steps = 1,000,000,000 steps, past the 100,000 one command may take"),
    (["--lengths", *map(str, range(1, 201))], "= 160,000 steps, past the 100,000"),  # the default 400 steps
    (["--steps", "25001", "--lengths", "8", "16"], "= 100,004 steps, past the 100,000"),
    # told the total first: it is what a list that long is wrong in (and was found after a search for repeats, which
    # took 34 s over 60,000 lengths)
    (["--lengths", *["8"] * 2000], "ask for 2,000 lengths x 2 runs x 400 steps"),
])
def test_bottleneck_s_lengths_repeated_or_past_the_steps_of_one_command_are_refused_before_training(argv, says,
                                                                                                     capsys,
                                                                                                     monkeypatch):
    err = refused_before_training(["--bottleneck", *argv], monkeypatch, capsys)
    assert err.startswith("error: --lengths ") and says in err and len(err) < 250, err


def test_bottleneck_s_lengths_within_the_steps_of_one_command_are_run(capsys, monkeypatch):
    tables = []
    monkeypatch.setattr(lab.sort, "bottleneck_table", lambda cfg, lengths: tables.append((cfg.steps, lengths)) or [])
    assert main(["--bottleneck", "--steps", "25000", "--lengths", "8", "16"]) == 0
    assert main(["--bottleneck", "--lengths", *map(str, range(1, 126))]) == 0  # 125 x 2 x 400 steps
    assert tables == [(25000, [8, 16]), (400, list(range(1, 126)))]


def test_the_heatmap_s_rows_are_the_models_own_output_with_the_right_digit_where_it_is_wrong(monkeypatch):
    # The rows were labelled with the right answer, [1 1 3 3 4 5 8 9], over the weights taken while the model wrote
    # its own, [6 8 4 4 4 4 4 4]
    import lab.sort_outputs
    from lab.sort_outputs import heatmap_of

    cfg = SortConfig(steps=1, eval_size=20)
    result = run(cfg)
    said = result.model.greedy(result.example[None])[0][0].tolist()  # the model's answer to the example alone
    right = sorted(result.example.tolist())
    assert said != right  # one step of training: wrong
    drawn = []
    monkeypatch.setattr(lab.sort_outputs, "render_attention_map", lambda *a, **k: drawn.append((a, k)))
    heatmap_of(result, cfg)
    ((weights, rows, _), options), = drawn
    assert rows == [str(s) if s == r else f"{s} ({r})" for s, r in zip(said, right, strict=True)]
    assert torch.equal(weights, result.weights)
    assert options["rows"] == "the model's output (the right digit in brackets where it is wrong)"


@pytest.mark.parametrize(("argv", "says"), [
    # its step varies with the threads' sums (7 and 10 seen)
    (["--model", "transformer", "--lr", "1e4", "--steps", "40"],
     r"the loss became nan at step \d+ of 40 \(transformer \(64 wide, .*\), length 8\); give a lower --lr than 10000"),
    (["--lr", "1e30", "--steps", "3"], r"the loss became nan at step 3 of 3 \(GRU, additive attention, length 8\); "
                                       r"give a lower --lr than 1e\+30"),
    (["--lr", "1e30", "--steps", "2"], r"the weights became non-finite at the last step, 2 \(GRU"),  # the loss was not
])
def test_a_run_whose_training_diverges_says_so_in_one_line_draws_nothing_and_exits_2(argv, says, tmp_path, capsys):
    # It exited 0 with an accuracy of 0% and a heatmap that painted the weights, all nan, as 0
    path, logs = tmp_path / "h.png", tmp_path / "logs"
    assert main([*argv, "--batch-size", "16", "--heatmap", str(path), "--logdir", str(logs)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and re.match(f"error: training diverged: {says}", err), err
    assert not path.exists() and any(logs.iterdir())  # the losses logged until then are kept


def test_a_bottleneck_run_that_diverges_keeps_the_rows_printed_and_says_which_run(capsys):
    assert main(["--bottleneck", "--lengths", "4", "--lr", "1e30", "--steps", "3", "--batch-size", "16"]) == 2
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == "length  attention  no attention"
    assert err == ("error: training diverged: the loss became nan at step 3 of 3 (GRU, additive attention, length 4); "
                   "give a lower --lr than 1e+30\n")
