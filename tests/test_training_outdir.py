"""Tests for training/outdir.py: one live run per out_dir (an OS lock that dies with its process), and --overwrite,
which keeps the old run until the new one has its first checkpoint."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, tiny_overrides, train_small_run
from test_train import child_env, snapshot
from test_training_signals import signal_at
from training_runs import TINY, call, train_main, write_corpus

import training.lock
import training.loop
import training.outdir
from configs.userinput import shown
from model import load_checkpoint
from training.errors import UsageError
from training.lock import LOCK, RunLock
from training.outdir import ASIDE


def start_live_run(tmp_path: Path, out: Path) -> subprocess.Popen:
    """A real train.py that trains for a long time in out; returns once it holds out_dir (its first step line)."""
    overrides = tiny_overrides(write_corpus(tmp_path), out, **{"train.max_iters": 10**6, "train.log_interval": 1,
                                                                "train.eval_interval": 10**6})
    proc = subprocess.Popen([sys.executable, "train.py", "--config", TINY, *overrides], cwd=ROOT, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("step 1/"):
            return proc
    raise AssertionError(proc.stderr.read())


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """conftest's train_small_run, trained once for the tests that each take a copy of it (small_run)."""
    return train_small_run(tmp_path_factory.mktemp("trained_once"))


@pytest.fixture
def small_run(trained_once: Path, tmp_path: Path) -> Path:
    """What train_small_run(tmp_path) leaves, tmp_path/corpus.txt and a run of it in tmp_path/out, made as a copy: for
    the tests whose run is overwritten, or refused, not continued. Its config.yaml names the folder it was trained in,
    which neither reads. Trained in each test, 14 runs took 3.5 s of CPU (2026-12-05, 2-core AMD EPYC (Zen 3, AVX2))."""
    write_corpus(tmp_path)
    return Path(shutil.copytree(trained_once, tmp_path / "out"))


def test_the_lock_is_taken_once_and_released(tmp_path) -> None:
    first, second = RunLock(tmp_path), RunLock(tmp_path)
    assert first.busy() is None
    first.acquire()
    assert f"process {os.getpid()}" in second.busy()
    with pytest.raises(UsageError, match=rf"is in use by a run that is still going \(process {os.getpid()} on "):
        second.acquire()
    first.release()
    assert second.busy() is None
    second.acquire()  # a released lock is free again, though its file stays
    second.release()
    assert (tmp_path / LOCK).exists()


def test_a_lock_hard_linked_to_another_file_leaves_that_file_as_it_was(tmp_path) -> None:
    """A .lock that is a hard link (another name of a user's file) had the run truncate that file and write its pid
    into it. Now .lock becomes a file of its own, and the other name keeps its bytes; while a live run holds the lock
    through the other name, the run is refused as for a run in out_dir."""
    out, outside = tmp_path / "out", tmp_path / "precious.txt"
    out.mkdir()
    outside.write_text(PRECIOUS, encoding="utf-8")
    os.link(outside, out / LOCK)
    holder = os.open(outside, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UsageError, match="is in use by a run that is still going"):
            RunLock(out).acquire()
    finally:
        os.close(holder)  # and with it the lock
    lock = RunLock(out)
    lock.acquire()
    try:
        assert outside.read_text(encoding="utf-8") == PRECIOUS and os.stat(outside).st_nlink == 1
        assert os.stat(out / LOCK).st_nlink == 1
        assert (out / LOCK).read_text(encoding="utf-8").split()[0] == str(os.getpid())
        assert f"process {os.getpid()}" in RunLock(out).busy()  # the new file is the one held
        assert sorted(p.name for p in out.iterdir()) == [LOCK]  # no temporary file left
    finally:
        lock.release()


def test_a_run_that_locks_a_lock_file_just_replaced_opens_the_new_one(tmp_path, monkeypatch) -> None:
    """Two runs start at once on a hard-linked .lock: the second opened the old file, the first locked it, gave .lock
    a file of its own and let the old one go, and the second then locked the old one: two live runs in one out_dir,
    and the pid written into the other name's file. The lock taken is checked to be the file still named .lock."""
    out, outside = tmp_path / "out", tmp_path / "precious.txt"
    out.mkdir()
    outside.write_text(PRECIOUS, encoding="utf-8")
    os.link(outside, out / LOCK)
    first, second = RunLock(out), RunLock(out)
    real_flock, between = fcntl.flock, []

    def the_first_gets_in_between(fd, operation):
        if not between:  # the second has opened the old file: the first takes .lock whole before it locks
            between.append(fd)
            first.acquire()
        return real_flock(fd, operation)

    monkeypatch.setattr(training.lock.fcntl, "flock", the_first_gets_in_between)
    try:
        with pytest.raises(UsageError, match=rf"in use by a run that is still going \(process {os.getpid()} on "):
            second.acquire()
    finally:
        first.release()
    assert outside.read_text(encoding="utf-8") == PRECIOUS


def test_a_look_at_a_lock_file_just_replaced_sees_the_run_holding_the_new_one(tmp_path, monkeypatch) -> None:
    """The same race for busy(), which --overwrite and reading a live run's checkpoint ask: it opened the old file, a
    run starting then gave .lock a file of its own and let the old one go, and busy() found the old one free and
    said no run held out_dir."""
    out, outside = tmp_path / "out", tmp_path / "precious.txt"
    out.mkdir()
    outside.write_text(PRECIOUS, encoding="utf-8")
    os.link(outside, out / LOCK)
    run, real_flock, between = RunLock(out), fcntl.flock, []

    def the_run_gets_in_between(fd, operation):
        if not between:
            between.append(fd)
            run.acquire()
        return real_flock(fd, operation)

    monkeypatch.setattr(training.lock.fcntl, "flock", the_run_gets_in_between)
    try:
        assert f"process {os.getpid()}" in (RunLock(out).busy() or "no run")
    finally:
        run.release()


@pytest.mark.slow
def test_a_second_run_a_resume_or_an_overwrite_of_a_live_run_is_refused_naming_it(tmp_path, capsys) -> None:
    out = tmp_path / "live"
    proc = start_live_run(tmp_path, out)
    try:
        corpus = write_corpus(tmp_path)
        attempts = [
            ["--config", TINY, *tiny_overrides(corpus, out, **{"model.n_layer": 1})],
            ["--resume", "--out-dir", str(out)],
            ["--config", TINY, "--overwrite", *tiny_overrides(corpus, out)],
        ]
        for args in attempts:
            before = snapshot(out)
            code, _, err = call(train_main, args, capsys)
            assert code == 2, err
            assert err.strip() == (f"error: '{shown(out)}' is in use by a run that is still going (process "
                                   f"{proc.pid} on {os.uname().nodename}); wait for it to end or stop it, or choose "
                                   f"another out_dir")
            # the live run's own TensorBoard file may grow meanwhile; nothing else may change
            assert {k: v for k, v in snapshot(out).items() if not k.startswith("events.")} == {
                k: v for k, v in before.items() if not k.startswith("events.")}
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    # kill -9 leaves no stale lock: the folder is free for a resume at once (the run saved nothing: start afresh)
    assert RunLock(out).busy() is None


def test_overwrite_says_what_it_replaces_and_drops_the_old_run_after_the_first_checkpoint(tmp_path, capsys,
                                                                                          small_run) -> None:
    run = small_run
    old = load_checkpoint(run / "ckpt.pt")["model"]
    code, out, err = call(train_main, ["--config", TINY, "--overwrite", *tiny_overrides(tmp_path / "corpus.txt", run,
                                                                                  seed=5)], capsys)
    assert code == 0, err
    replaced = "(ckpt.pt, best.pt, config.yaml, 1 TensorBoard file(s))"
    assert f"overwrite: replacing the run in '{shown(run)}' {replaced}" in out
    assert not (run / ASIDE).exists()
    new = load_checkpoint(run / "ckpt.pt")["model"]
    assert not torch.equal(old["lm_head.weight"], new["lm_head.weight"])
    assert len(list(run.glob("events.out.tfevents.*"))) == 1


def test_an_overwrite_that_fails_before_its_first_checkpoint_gives_the_old_run_back(tmp_path, capsys, monkeypatch,
                                                                                   small_run) -> None:
    run = small_run
    before = {name: content for name, (content, _) in snapshot(run).items()}

    def diverge(self):
        raise FloatingPointError("the first step went wrong")

    monkeypatch.setattr(training.loop.Trainer, "train_step", diverge)
    with pytest.raises(FloatingPointError):
        train_main(["--config", TINY, "--overwrite", *tiny_overrides(tmp_path / "corpus.txt", run)])
    after = {name: content for name, (content, _) in snapshot(run).items()}
    assert after == before  # every file of the old run back, byte for byte, and nothing of the new one


def test_an_overwrite_whose_config_yaml_cannot_be_written_gives_the_old_run_back(tmp_path, capsys, monkeypatch,
                                                                                 small_run) -> None:
    """A full disk at the new config.yaml, just after the old run had moved aside: the line said "choose another
    out_dir", and the old run stayed in .replaced/, where sample.py --out-dir and a plain run refused the folder."""
    run = small_run
    before = {name: content for name, (content, _) in snapshot(run).items()}
    real = training.outdir.write_atomic

    def full_disk(path, write):
        if path.name == "config.yaml":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, write)

    monkeypatch.setattr(training.outdir, "write_atomic", full_disk)
    code, _, err = call(train_main, ["--config", TINY, "--overwrite", *tiny_overrides(tmp_path / "corpus.txt", run)],
                        capsys)
    assert code == 2
    assert err == (f"error: cannot write into out_dir '{shown(run)}' ('{shown(run / 'config.yaml')}': No space left "
                   f"on device); the run it was replacing is back in place; choose another out_dir\n")
    after = {name: content for name, (content, _) in snapshot(run).items()}
    assert after == before  # every file of the old run back, byte for byte, and no .replaced/


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_before_an_overwrites_first_checkpoint_gives_the_old_run_back(tmp_path, capsys, monkeypatch,
                                                                             signum, small_run) -> None:
    run = small_run
    before = {name: content for name, (content, _) in snapshot(run).items()}
    monkeypatch.setattr(training.loop, "lr_at", signal_at(3, signum))
    code, _, err = call(train_main, ["--config", TINY, "--overwrite", *tiny_overrides(tmp_path / "corpus.txt", run)],
                        capsys)
    assert code == 128 + signum
    assert err == (f"stopped at step 4, before this --overwrite run's first checkpoint: nothing of it was saved, and "
                   f"the run it was replacing is back in '{shown(run)}'\n")
    after = {name: content for name, (content, _) in snapshot(run).items()}
    assert after == before  # every file of the old run back, best.pt included, and nothing of the new one


def test_a_stop_after_an_overwrites_first_checkpoint_saves_as_any_stop_does(tmp_path, capsys, monkeypatch,
                                                                            small_run) -> None:
    run = small_run
    monkeypatch.setattr(training.loop, "lr_at", signal_at(12, signal.SIGINT))
    code, _, err = call(train_main, ["--config", TINY, "--overwrite", *tiny_overrides(tmp_path / "corpus.txt", run)],
                        capsys)
    assert code == 130 and err.startswith("stopped at step 13: saved "), err
    assert load_checkpoint(run / "ckpt.pt")["step"] == 13 and not (run / ASIDE).exists()


def test_a_run_killed_in_the_middle_of_an_overwrite_leaves_the_old_run_to_be_put_back(tmp_path, capsys,
                                                                                       small_run) -> None:
    run = small_run
    before = load_checkpoint(run / "ckpt.pt")["step"]
    aside = run / ASIDE
    aside.mkdir()
    for name in ("ckpt.pt", "best.pt", "config.yaml"):
        os.replace(run / name, aside / name)  # as a kill -9 after the move aside, before the first save, leaves it
    code, _, err = call(train_main, ["--config", TINY, *tiny_overrides(tmp_path / "corpus.txt", run)], capsys)
    assert code == 2 and "already holds a run (.replaced/ckpt.pt)" in err  # still a run: not silently replaced
    code, _, err = call(train_main, ["--config", TINY, "--overwrite", "--out-dir", str(run), "train.max_iters=0",
                                     f"data.path={tmp_path / 'corpus.txt'}", "model.n_layer=2", "model.n_head=2",
                                     "model.n_embd=16", "train.batch_size=8", "train.eval_iters=2"], capsys)
    assert code == 0, err
    assert not aside.exists() and load_checkpoint(run / "ckpt.pt")["step"] == 0 != before


def test_resume_puts_back_and_continues_the_run_that_a_killed_overwrite_left_aside(tmp_path, capsys) -> None:
    run = train_small_run(tmp_path, **{"train.max_iters": 10})
    events = {p.name for p in run.glob("events.out.tfevents.*")}
    aside = run / ASIDE
    aside.mkdir()
    for path in [run / "ckpt.pt", run / "best.pt", run / "config.yaml", *run.glob("events.out.tfevents.*")]:
        os.replace(path, aside / path.name)  # as a kill -9 after the move aside, before the first save, leaves it
    (run / "config.yaml").write_text("the killed run's\n", encoding="utf-8")
    code, out, err = call(train_main, ["--resume", "--out-dir", str(run), "train.max_iters=20"], capsys)
    assert code == 0, err
    assert "resume: the run that an interrupted --overwrite left in .replaced/ is put back and continued" in out
    assert not aside.exists()
    resumed = load_checkpoint(run / "ckpt.pt")
    assert resumed["step"] == 20 and resumed["config"]["train"]["max_iters"] == 20
    assert (run / "best.pt").exists() and yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    assert events < {p.name for p in run.glob("events.out.tfevents.*")}  # the old run's curves back, and continued


def test_a_killed_overwrite_of_a_run_with_best_pt_alone_leaves_a_run_that_resume_says_how_to_continue(tmp_path,
                                                                                                      capsys) -> None:
    # A run folder holding best.pt alone (ckpt.pt deleted for room), replaced by an --overwrite killed before its
    # first checkpoint: a plain run put it back and then said that "another run saved while this one was starting",
    # and --resume said "nothing to resume ...; start the run without --resume".
    run = train_small_run(tmp_path)
    (run / "ckpt.pt").unlink()
    events = {p.name for p in run.glob("events.out.tfevents.*")}
    aside = run / ASIDE
    aside.mkdir()
    for path in [run / "best.pt", run / "config.yaml", *run.glob("events.out.tfevents.*")]:
        os.replace(path, aside / path.name)
    (run / "config.yaml").write_text("the killed run's\n", encoding="utf-8")
    code, _, err = call(train_main, ["--config", TINY, *tiny_overrides(tmp_path / "corpus.txt", run)], capsys)
    assert code == 2 and "already holds a run (.replaced/best.pt); continue it with --resume" in err, err
    assert (aside / "best.pt").is_file()
    code, _, err = call(train_main, ["--resume", "--out-dir", str(run)], capsys)
    assert code == 2
    way = f"cd {run} && mv .replaced/* . && rmdir .replaced && cp best.pt ckpt.pt"
    assert err.rstrip("\n").endswith(f"nothing to resume: no '{shown(run / 'ckpt.pt')}', only best.pt, the run's best "
                                      f"step; to continue from that step, put back the run that an interrupted "
                                      f"--overwrite left in .replaced/, and copy it: {way}"), err
    subprocess.run(way, shell=True, check=True)
    code, _, err = call(train_main, ["--resume", "--out-dir", str(run), "train.max_iters=30"], capsys)
    assert code == 0, err
    assert load_checkpoint(run / "ckpt.pt")["step"] == 30
    assert events < {p.name for p in run.glob("events.out.tfevents.*")}  # the old run's curves kept, and continued


def test_a_run_that_reaches_the_claim_second_is_refused_with_the_lock_s_own_line(tmp_path) -> None:
    """Two runs may pass the early check together; the one that claims the folder second is refused by the lock
    itself, in the same words, and leaves the first run's lock alone."""
    from training.config import load_config
    from training.outdir import claim_out_dir

    cfg = load_config(TINY, [f"out_dir={tmp_path / 'out'}"])
    lock, _ = claim_out_dir(tmp_path / "out", cfg, resume=False, overwrite=False)
    try:
        with pytest.raises(UsageError) as info:
            claim_out_dir(tmp_path / "out", cfg, resume=False, overwrite=False)
        assert str(info.value).startswith(f"'{shown(tmp_path / 'out')}' is in use by a run that is still going "
                                          f"(process ")
        assert RunLock(tmp_path / "out").busy() is not None  # still held by the first
    finally:
        lock.release()


# ------------------------------------------------------------------------------------- a .lock no run made

PRECIOUS = "a file of the user's, outside out_dir\n"
NOT_A_FILE = {"link": "a symbolic link", "dangling link": "a symbolic link", "pipe": "a named pipe",
              "folder": "a folder", "socket": "a socket"}


def put_in_place_of_the_lock(kind: str, lock: Path, outside: Path) -> None:
    """A .lock of the given kind: what a mistake or a hostile folder may hold (a device needs root, so is left out)."""
    if kind == "link":
        lock.symlink_to(outside)
    elif kind == "dangling link":
        lock.symlink_to(outside.with_name("made-by-the-run"))
    elif kind == "pipe":
        os.mkfifo(lock)
    elif kind == "folder":
        lock.mkdir()
    else:  # bound by its short name: a socket's full path may be longer than the 108 bytes a socket name allows
        with contextlib.chdir(lock.parent), socket.socket(socket.AF_UNIX) as s:
            s.bind(lock.name)


@contextlib.contextmanager
def no_waiting(seconds: float) -> Iterator[None]:
    """The block fails after seconds instead of waiting for ever, as opening a named pipe for reading does: SIGALRM
    interrupts the open, and its handler raises."""
    def give_up(signum: int, frame: object) -> None:
        raise AssertionError(f"still waiting after {seconds} s")

    previous = signal.signal(signal.SIGALRM, give_up)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def without_the_lock(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.name != LOCK}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_small_run(tmp_path_factory.mktemp("finished"), **{"train.max_iters": 0})


@pytest.mark.parametrize("mode", ["resume", "overwrite", "new run"])
@pytest.mark.parametrize("kind", list(NOT_A_FILE))
def test_a_lock_that_is_not_a_file_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys, finished_run,
                                                                                   kind, mode) -> None:
    """A link named .lock once had the run write its pid into the file it named, outside out_dir; a named pipe had it
    wait for ever; a folder or a socket gave a line that did not name it. Each is refused, naming it, and neither
    out_dir nor anything outside it changes."""
    outside = tmp_path / "precious.txt"
    outside.write_text(PRECIOUS, encoding="utf-8")
    corpus = write_corpus(tmp_path)
    run = tmp_path / "run"
    if mode == "new run":
        run.mkdir()
    else:
        shutil.copytree(finished_run, run)
        (run / LOCK).unlink()
    put_in_place_of_the_lock(kind, run / LOCK, outside)
    before = without_the_lock(run)
    args = {"resume": ["--resume", "--out-dir", str(run)],
            "overwrite": ["--config", TINY, "--overwrite", *tiny_overrides(corpus, run)],
            "new run": ["--config", TINY, *tiny_overrides(corpus, run)]}[mode]
    with no_waiting(30):
        code, _, err = call(train_main, args, capsys)
    assert code == 2, err
    assert err == (f"error: '{shown(run / LOCK)}' is {NOT_A_FILE[kind]}, not a lock file that tinychar made; remove "
                   f"it (a run makes its own .lock), or choose another out_dir\n")
    assert without_the_lock(run) == before
    assert outside.read_text(encoding="utf-8") == PRECIOUS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "precious.txt", "run"]  # no link's target made


@pytest.mark.parametrize("kind", ["link", "pipe"])
def test_a_lock_swapped_after_it_was_looked_at_is_neither_followed_nor_waited_on(tmp_path, monkeypatch, kind) -> None:
    """Another .lock may take the place of the one looked at before it is opened: the opening itself neither follows
    a link nor waits for a pipe's writer, and the refusal is the same."""
    outside = tmp_path / "precious.txt"
    outside.write_text(PRECIOUS, encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    put_in_place_of_the_lock(kind, out / LOCK, outside)
    real_lstat = os.lstat
    looks = []

    def lstat(path, *args, **kwargs):
        if Path(path) == out / LOCK and not looks:  # the first look, just before the swap: nothing there yet
            looks.append(path)
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", lstat)
    lock = RunLock(out)
    opening = lock.busy if kind == "pipe" else lock.acquire  # busy reads, which waits on a pipe; acquire writes
    with no_waiting(30), pytest.raises(UsageError, match=f"is {NOT_A_FILE[kind]}, not a lock file that tinychar made"):
        opening()
    assert looks and outside.read_text(encoding="utf-8") == PRECIOUS


USERS_CONFIG = ("# my experiment: careful notes here\nmodel:\n  n_layer: 2\n  n_head: 2\n  n_embd: 16\n"
                "train:\n  max_iters: 0\n  eval_iters: 2\n  batch_size: 8\n  compile: false\n")


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_config_yaml_of_the_users_in_out_dir_is_refused_and_left_alone(tmp_path, capsys, overwrite) -> None:
    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / "config.yaml").write_text(USERS_CONFIG, encoding="utf-8")
    corpus = write_corpus(tmp_path)
    code, _, err = call(train_main, ["--config", str(folder / "config.yaml"), f"out_dir={folder}",
                                     f"data.path={corpus}", *overwrite], capsys)
    assert code == 2
    assert err == (f"error: '{shown(folder / 'config.yaml')}' is not a config.yaml that tinychar wrote, and this run "
                   f"would replace it with its own; move it out of the folder, or choose another out_dir\n")
    assert [p.name for p in folder.iterdir()] == ["config.yaml"]
    assert (folder / "config.yaml").read_text(encoding="utf-8") == USERS_CONFIG


@pytest.mark.parametrize("flags", [[], ["--overwrite"]])
def test_a_lock_or_replaced_folder_of_the_users_is_refused_and_left_alone(tmp_path, capsys, flags) -> None:
    """A .lock of a person's was overwritten with the run's process id; a .replaced/ of theirs was emptied into
    out_dir as an --overwrite killed midway would be put back (and a later --overwrite deleted it)."""
    corpus = write_corpus(tmp_path)
    for name, path in ((LOCK, Path(LOCK)), *((f, Path(f) / "notes.txt") for f in (ASIDE, ".replacing", ".restoring"))):
        folder = tmp_path / f"exp{name}"
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text("my precious notes\n", encoding="utf-8")
        code, _, err = call(train_main, ["--config", TINY, f"out_dir={folder}", f"data.path={corpus}", *flags],
                            capsys)
        assert code == 2
        if name == LOCK:
            assert err == (f"error: '{shown(folder / LOCK)}' holds something a run did not write (a run's .lock holds "
                           f"its process id and host); move the file away, or choose another out_dir\n")
        else:
            assert err == (f"error: '{shown(folder / name)}' holds what no --overwrite put there (notes.txt), and a "
                           f"run replaces or empties that folder; move it out of out_dir, or choose another out_dir\n")
        assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == sorted({path, *path.parents} - {Path(".")})
        assert (folder / path).read_text(encoding="utf-8") == "my precious notes\n"


def test_the_config_yaml_a_run_wrote_is_known_as_a_runs_own(tmp_path, capsys) -> None:
    """Marked, it is replaced by a run into its folder, as is an unmarked one (from before the mark) beside .lock."""
    corpus = write_corpus(tmp_path)
    run = train_small_run(tmp_path, **{"train.max_iters": 0})
    assert (run / "config.yaml").read_bytes().startswith(b"# tinychar: ")
    for name in ("ckpt.pt", "best.pt", LOCK):  # a folder holding only the config.yaml of a run
        (run / name).unlink(missing_ok=True)
    code, _, err = call(train_main, ["--config", str(run / "config.yaml"), "train.max_iters=0"], capsys)
    assert code == 0, err
    old = run / "config.yaml"
    old.write_bytes(old.read_bytes().split(b"\n", 1)[1])  # written before the mark: known by .lock
    (run / "ckpt.pt").unlink()
    (run / "best.pt").unlink(missing_ok=True)
    code, _, err = call(train_main, ["--config", TINY, *tiny_overrides(corpus, run, **{"train.max_iters": 0})], capsys)
    assert code == 0, err


@pytest.mark.parametrize(("entry", "make", "flags"), [
    ("config.yaml", lambda p: p.mkdir(), []),
    (".replaced", lambda p: p.write_text("a file where --overwrite puts the old run aside"), ["--overwrite"]),
])
def test_an_entry_of_out_dir_in_the_way_is_named(tmp_path, capsys, trained_once, entry, make, flags):
    # The line said only "(Is a directory)" or "(File exists)", naming no entry of the folder.
    out = tmp_path / "out"
    if flags:
        shutil.copytree(trained_once, out)
    else:
        out.mkdir()
    make(out / entry)

    def files() -> dict:  # what is there but the lock, which any run takes and writes its process id into
        return {p.name: p.is_dir() or p.read_bytes() for p in out.iterdir() if p.name != ".lock"}

    before = files()
    code, _, err = call(train_main, ["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out), *flags], capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"cannot write into out_dir '{shown(str(out))}' ('{shown(str(out / entry))}': " in err
    assert files() == before


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_saved_into_out_dir_while_this_one_was_starting_is_never_written_over(tmp_path, capsys, monkeypatch,
                                                                                     resume):
    """The checks ran before the corpus was read and the model built, the lock was taken after: a second run into
    the same out_dir, checked while a first one was still going (minutes, for a large corpus's first encoding),
    replaced that run's checkpoints once it had ended, exit status 0; a resume wrote its older step over them."""
    import training.runner

    for name in ("first", "other"):
        (tmp_path / name).mkdir()
    out = train_small_run(tmp_path / "first")
    other = train_small_run(tmp_path / "other", **{"train.max_iters": 10})  # what the other run saves meanwhile
    real = training.runner.prepare_corpus

    def another_run_saves_meanwhile(*args, **kwargs):
        for name in ("ckpt.pt", "best.pt"):
            (out / name).unlink(missing_ok=True)
            if not resume or name == "ckpt.pt":
                shutil.copy2(other / name, out / name)
        return real(*args, **kwargs)

    if not resume:  # a fresh run: out_dir held no run when it was checked
        for name in ("ckpt.pt", "best.pt", "config.yaml"):
            (out / name).unlink()
    monkeypatch.setattr(training.runner, "prepare_corpus", another_run_saves_meanwhile)
    args = ["--resume", "--out-dir", str(out)] if resume else ["--config", TINY, *tiny_overrides(
        write_corpus(tmp_path), out)]
    code, _, err = call(train_main, args + (["train.max_iters=30"] if resume else []), capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    if resume:
        assert err == (f"error: '{shown(str(out / 'ckpt.pt'))}' was replaced by another run while this one was "
                       f"starting, and this run would write over its steps; resume again to continue from the new "
                       f"one\n")
    else:
        assert err == (f"error: '{shown(str(out))}' now holds a run (ckpt.pt) that another run saved while this one "
                       f"was starting; continue it with --resume, choose another out_dir=..., or start afresh with "
                       f"--overwrite\n")
        assert (out / "best.pt").read_bytes() == (other / "best.pt").read_bytes()
    assert (out / "ckpt.pt").read_bytes() == (other / "ckpt.pt").read_bytes()
    assert load_checkpoint(out / "ckpt.pt")["step"] == 10
    assert not RunLock(out).busy()  # released on the refusal


# ------------------------------------------------------------------------------------------ --overwrite killed midway

OLD_RUN = {"ckpt.pt": b"old ckpt", "best.pt": b"old best", "config.yaml": b"# old config\n",
           "events.out.tfevents.1": b"old events 1", "events.out.tfevents.2": b"old events 2"}


def _killed_at(monkeypatch: pytest.MonkeyPatch, renames: int) -> None:
    """os.replace gives out after `renames` renames, as a kill -9 there would leave the folder."""
    real, done = os.replace, []

    def replace(a, b) -> None:
        if len(done) == renames:
            raise KeyboardInterrupt("killed")
        done.append(a)
        real(a, b)

    monkeypatch.setattr(os, "replace", replace)


def _run_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != LOCK}


@pytest.mark.parametrize("renames", range(len(OLD_RUN) + 2))
def test_an_overwrite_killed_while_moving_the_old_run_aside_leaves_all_of_it_to_put_back(tmp_path, monkeypatch,
                                                                                        renames):
    """Killed after ckpt.pt had gone into .replaced/, the old run's best.pt, config.yaml and TensorBoard logs stayed
    in out_dir, where the next run took them for the killed run's own and deleted them as it put the old run back."""
    from training.outdir import move_aside, recover_aside

    out = tmp_path / "run"
    out.mkdir()
    for name, content in OLD_RUN.items():
        (out / name).write_bytes(content)
    _killed_at(monkeypatch, renames)  # the files one by one, then their folder: len(OLD_RUN) + 1 renames in all
    with contextlib.suppress(KeyboardInterrupt):
        move_aside(out)
    monkeypatch.undo()
    recover_aside(out)  # the next run in the folder, which has no ckpt.pt of its own
    assert _run_files(out) == OLD_RUN and sorted(p.name for p in out.iterdir() if p.is_dir()) == []


@pytest.mark.parametrize("renames", range(len(OLD_RUN) + 2))
def test_a_run_killed_while_putting_the_old_run_back_leaves_all_of_it_to_put_back(tmp_path, monkeypatch, renames):
    """An --overwrite stopped before its first checkpoint puts the old run back: killed midway (a second signal),
    the files already back were taken for the new run's by the next run, and deleted, or the rest were dropped."""
    from training.outdir import move_aside, recover_aside, restore_aside

    out = tmp_path / "run"
    out.mkdir()
    for name, content in OLD_RUN.items():
        (out / name).write_bytes(content)
    move_aside(out)
    (out / "config.yaml").write_bytes(b"# the new run's config\n")  # what the new run wrote before it was stopped
    (out / "events.out.tfevents.3").write_bytes(b"new events")
    _killed_at(monkeypatch, renames)  # the folder first, then the files one by one
    with contextlib.suppress(KeyboardInterrupt):
        restore_aside(out)
    monkeypatch.undo()
    recover_aside(out)
    assert _run_files(out) == OLD_RUN and sorted(p.name for p in out.iterdir() if p.is_dir()) == []


def test_an_out_dir_inside_a_data_folder_is_not_trained_on_and_the_run_resumes(tmp_path, capsys) -> None:
    """The first run trained on what its out_dir held (the person's notes there), then marked the folder as a run's;
    from then on the folder was left out of the text, and every resume was refused: "not the text this run was
    trained on"."""
    books = tmp_path / "books"
    books.mkdir()
    write_corpus(books)
    (books / "run").mkdir()
    (books / "run" / "notes.txt").write_text("notes for this experiment\n", encoding="utf-8")
    overrides = tiny_overrides(books, books / "run", **{"train.max_iters": 10})
    code, out, err = call(train_main, ["--config", TINY, *overrides], capsys)
    assert code == 0, err
    assert "left out what 1 tinychar run(s) wrote there" in out + err
    code, out, err = call(train_main, ["--config", TINY, "--resume", *overrides, "train.max_iters=12"], capsys)
    assert code == 0, err
    assert load_checkpoint(books / "run" / "ckpt.pt")["step"] == 12


def test_a_folder_named_best_pt_is_refused_before_a_resume_trains(tmp_path, capsys, small_run) -> None:
    """It was found only when the first better step came to be saved: the steps since trained, then exit 1 and a
    line that said to free some space."""
    run = small_run
    (run / "best.pt").unlink()
    (run / "best.pt").mkdir()
    (run / "best.pt" / "notes.txt").write_text(PRECIOUS, encoding="utf-8")

    def files() -> dict:  # what is there but the lock, which any run takes and writes its process id into
        return {p.name: p.is_dir() or (p.read_bytes(), p.stat().st_mtime_ns) for p in run.iterdir() if p.name != LOCK}

    before = files()
    code, _, err = call(train_main, ["--resume", "--out-dir", str(run), "train.max_iters=30"], capsys)
    assert code == 2
    assert err == (f"error: '{shown(run / 'best.pt')}' is a folder, where this run keeps its best checkpoint; move it "
                   f"out of out_dir, then --resume again\n")
    assert files() == before
    assert (run / "best.pt" / "notes.txt").read_text(encoding="utf-8") == PRECIOUS


@pytest.mark.parametrize("best", [True, False], ids=["best.pt beside it", "alone"])
def test_a_ckpt_pt_folder_is_refused_by_resume_with_advice_that_works(tmp_path, capsys, best, small_run) -> None:
    """--resume said "start afresh with --overwrite", which then refused the folder, or "copy best.pt over it", which
    copies best.pt into it."""
    run = small_run
    (run / "ckpt.pt").unlink()
    if not best:
        (run / "best.pt").unlink()
    (run / "ckpt.pt").mkdir()
    (run / "ckpt.pt" / "notes.txt").write_text(PRECIOUS, encoding="utf-8")
    before = {p.name: p.is_dir() or p.read_bytes() for p in run.iterdir() if p.name != LOCK}
    code, _, err = call(train_main, ["--resume", "--out-dir", str(run), "train.max_iters=30"], capsys)
    assert code == 2
    assert err == (f"error: '{shown(run / 'ckpt.pt')}' is a folder, where a run keeps the checkpoint --resume "
                   f"continues from; move it out of out_dir, then --resume again\n")
    assert {p.name: p.is_dir() or p.read_bytes() for p in run.iterdir() if p.name != LOCK} == before
    assert (run / "ckpt.pt" / "notes.txt").read_text(encoding="utf-8") == PRECIOUS


@pytest.mark.parametrize("name", ["best.pt", "ckpt.pt", "config.yaml", "events.out.tfevents.123.x.1.0"])
def test_a_folder_under_a_run_file_s_name_is_refused_before_an_overwrite_moves_it(tmp_path, capsys, name,
                                                                                   small_run) -> None:
    """--overwrite moved such a folder into .replaced/ with the run's files, and deleted it, with all it held, once
    the new run saved its first checkpoint."""
    run = small_run
    if (run / name).exists():
        (run / name).unlink()
    (run / name).mkdir()
    (run / name / "notes.txt").write_text(PRECIOUS, encoding="utf-8")
    before = {p.name: p.is_dir() or p.read_bytes() for p in run.iterdir() if p.name != LOCK}
    for flags in (["--overwrite"], []):  # without it, a best.pt folder was a run to continue or to --overwrite
        if not flags and name == "config.yaml":
            continue  # a new run says that a config.yaml is in its way (test_an_entry_of_out_dir_in_the_way_is_named)
        code, _, err = call(train_main, ["--config", TINY, *tiny_overrides(tmp_path / "corpus.txt", run), *flags],
                            capsys)
        assert code == 2
        assert err == (f"error: '{shown(run / name)}' is a folder, where a run keeps a file of its own; move it out of "
                       f"out_dir, or choose another out_dir\n")
        assert {p.name: p.is_dir() or p.read_bytes() for p in run.iterdir() if p.name != LOCK} == before
        assert (run / name / "notes.txt").read_text(encoding="utf-8") == PRECIOUS
