"""data/bench.py, the benchmark of the streaming pipeline: it runs as `python data/bench.py` as well as with -m, its
table and JSON hold figures that make sense, and it removes only the folder it made, never what --workdir held."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import ROOT, SMALL_TEXT

import data.bench as bench
import data.bench_report
from configs.userinput import shown


def test_the_work_folder_is_a_new_one_inside_workdir_and_only_made_folders_are_listed(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    (tmp_path / "mine").mkdir()
    work, made = bench._work_folder(str(tmp_path / "mine"))
    assert work.parent == tmp_path / "mine" and work.name.startswith("tinychar-bench-") and made == []
    work, made = bench._work_folder(str(tmp_path / "new" / "deeper"))
    assert work.parent == tmp_path / "new" / "deeper" and made == [tmp_path / "new" / "deeper", tmp_path / "new"]
    (tmp_path / "afile").write_text("a file", encoding="utf-8")
    for where in ("afile", "afile/sub"):  # it said "File exists"
        with pytest.raises(NotADirectoryError, match="Not a directory"):
            bench._work_folder(str(tmp_path / where))
    monkeypatch.chdir(tmp_path)  # the children start in the project's folder: the path they are given is whole
    assert bench._work_folder("mine")[0].parent == tmp_path / "mine"


@pytest.mark.parametrize(
    "args", [["--size-mb", "nan"], ["--size-mb", "inf"], ["--size-mb", "-1"], ["--size-mb", "many"],
             ["--size-mb", "0.01"], ["--train-memory-cap-gb", "nan"]]
)
def test_sizes_no_bench_can_have_are_refused_before_it_begins(args: list[str], capsys) -> None:
    # nan and inf were tracebacks from int(), and 0 or 0.01 one from inside the bench, once it had made its folder
    with pytest.raises(SystemExit) as info:
        bench.main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: argument {args[0]}: ")  # one line, not usage and all


def test_a_size_beyond_the_free_disk_or_a_json_it_cannot_write_is_one_line(tmp_path: Path, monkeypatch, capsys):
    # --size-mb 1e15 was a MemoryError traceback, and a --json that could not be written one after the whole bench
    monkeypatch.setattr(bench, "_measure", lambda args, work, shakespeare: {})
    monkeypatch.setattr(data.bench_report, "table", lambda results: "| the table |")
    assert bench.main(["--workdir", str(tmp_path), "--size-mb", "1e15"]) == 2
    assert capsys.readouterr().err.startswith("error: --size-mb 1e+15 needs about 4,000,000,000,000,000 MB of disk, "
                                              "more than ")
    (tmp_path / "out").mkdir()  # removed while the bench runs: the figures cannot go there at the end
    monkeypatch.setattr(bench, "_measure", lambda args, work, shakespeare: (tmp_path / "out").rmdir() or {})
    assert bench.main(["--workdir", str(tmp_path), "--json", str(tmp_path / "out" / "b.json")]) == 1
    out, err = capsys.readouterr()
    json_path = shown(str(tmp_path / "out" / "b.json"))  # as messages show a path: cut in its middle past 80
    assert out == "| the table |\n"
    assert err.startswith(f"error: --json: cannot write '{json_path}' (no folder ") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # the bench's folder removed, as ever


def test_what_would_fail_after_the_run_is_refused_before_it(tmp_path: Path, monkeypatch, capsys):
    # --json onto a person's file replaced it; --json '' was ignored; --workdir '' ran the whole default bench in the
    # temp folder; a --train-script that is not there ran the bench and put "failed" in the table, status 0
    monkeypatch.setattr(bench, "_measure", lambda *a: pytest.fail("measured"))
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n", encoding="utf-8")
    for args, says in ((["--json", str(notes)], "holds something other than an earlier result of this bench"),
                       (["--json", ""], "'' is empty"), (["--json", str(tmp_path)], "is a folder"),
                       (["--workdir", ""], "--workdir: '' is empty"),
                       (["--train-script", str(tmp_path / "nope.py")], "--train-script: no file")):
        with pytest.raises(SystemExit) as info:
            bench.main(args)
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.count("\n") == 1 and says in err, err
    assert notes.read_text(encoding="utf-8") == "my notes\n"


def test_a_json_pipe_is_written_into_unread_and_a_json_nowhere_is_refused_before_the_run(tmp_path: Path, monkeypatch,
                                                                                          capsys):
    # --json's file was read whenever it existed: a named pipe waited for a writer before the bench began (and
    # /dev/full was read until memory ran out); a --json in a folder that is not there, a link to one, or a loop of
    # links was found only when the whole bench had run. bench.py's checks now (benchmark/jsonfile.py).
    monkeypatch.setattr(bench, "_measure", lambda *a: pytest.fail("measured"))
    # named from their folder: the line is cut past 400 characters, which a link's three paths in a long temp folder
    # (macOS's /var/folders/...) passed, cutting "is a link to" out of it
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "dangling").symlink_to(Path("gone", "b.json"))
    for name, says in (("none/b.json", "no folder"), ("dangling", "is a link to"), ("loop", "go round in a loop")):
        with pytest.raises(SystemExit) as info:
            bench.main(["--workdir", str(tmp_path), "--json", name])
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.startswith("error: --json: ") and err.count("\n") == 1 and says in err
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(bench, "_measure", lambda *a: {"size_mb": 1, "workdir": "w"})
    monkeypatch.setattr(data.bench_report, "table", lambda results: "| the table |")
    read: list[str] = []
    reader = threading.Thread(target=lambda: read.append(fifo.read_text(encoding="utf-8")), daemon=True)
    reader.start()

    def hung(*args):
        raise TimeoutError("data.bench waited on --json's pipe")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        assert bench.main(["--workdir", str(tmp_path / "w"), "--no-train", "--json", str(fifo)]) == 0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    reader.join(20)
    assert read and json.loads(read[0]) == {"size_mb": 1, "workdir": "w"}
    assert capsys.readouterr().out == "| the table |\n"


def test_a_stdout_that_fails_loses_no_json_and_sigterm_or_sighup_stops_in_one_line(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "_measure", lambda *a: {"size_mb": 1, "workdir": "w"})
    monkeypatch.setattr(data.bench_report, "table", lambda results: "| the table |")
    monkeypatch.setattr(bench.os, "dup2", lambda *a: None)  # pytest's own stdout stays
    real_print = print

    def full(*args, **kwargs):
        if kwargs.get("file") is None:
            raise OSError(28, "No space left on device")
        real_print(*args, **kwargs)

    monkeypatch.setattr("builtins.print", full)
    assert bench.main(["--workdir", str(tmp_path), "--no-train", "--json", str(tmp_path / "r.json")]) == 1
    monkeypatch.setattr("builtins.print", real_print)
    assert json.loads((tmp_path / "r.json").read_text(encoding="utf-8")) == {"size_mb": 1, "workdir": "w"}
    assert capsys.readouterr().err == "error: cannot write the table to stdout (No space left on device)\n"

    def terminated(*args):
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(bench, "_measure", terminated)
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert bench.main(["--workdir", str(tmp_path / "w"), "--no-train"]) == 143
    finally:
        signal.signal(signal.SIGTERM, before)
    assert capsys.readouterr().err == "interrupted (SIGTERM); nothing measured is printed\n"
    assert not (tmp_path / "w").exists()  # the bench's folders removed, the one made for --workdir too

    def hung_up(*args):  # the terminal closed: SIGHUP killed the bench and left its folders behind
        assert callable(signal.getsignal(signal.SIGHUP)), "no handler: the signal would end pytest itself"
        signal.raise_signal(signal.SIGHUP)

    monkeypatch.setattr(bench, "_measure", hung_up)
    # as started from a terminal's shell, whatever this process's SIGHUP (under nohup, it is left ignored)
    monkeypatch.setattr("training.signals.STOP_SIGNALS", (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))
    before = signal.getsignal(signal.SIGHUP)
    try:
        assert bench.main(["--workdir", str(tmp_path / "w"), "--no-train"]) == 128 + signal.SIGHUP
    finally:
        signal.signal(signal.SIGHUP, before)
    assert capsys.readouterr().err == "interrupted (SIGHUP); nothing measured is printed\n"
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_run_by_its_path_it_reports_sane_figures_and_leaves_the_workdir_as_it_was(tmp_path: Path) -> None:
    """`python data/bench.py` failed with ModuleNotFoundError, and --workdir DIR deleted DIR and all it held."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "precious.txt").write_text("not the bench's", encoding="utf-8")
    report = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "data/bench.py", "--size-mb", "2", "--no-train", "--workdir", str(workdir), "--json", report],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in workdir.iterdir()] == ["precious.txt"]  # the bench's own sub-folder is gone, nothing else
    assert (workdir / "precious.txt").read_text(encoding="utf-8") == "not the bench's"

    r = json.loads(report.read_text(encoding="utf-8"))
    big, small, again = r["prepare"]["big"], r["prepare"]["small"], r["prepare"]["big_again"]
    assert Path(r["workdir"]).parent == workdir and "train" not in r
    # 2 MB of bytes, some of them 3-byte CJK characters: fewer characters than bytes, every CJK one in the vocabulary
    assert big["bytes"] == 2_000_000 and 1_900_000 < big["n_tokens"] < 2_000_000 and big["dtype"] == "uint16"
    assert small["bytes"] == 1_000_000 and big["vocab"] >= small["vocab"] > bench.N_CJK
    assert not big["cache_hit"] and again["cache_hit"] and again["n_tokens"] == big["n_tokens"]
    for figures in (big, small, *r["batches"].values()):
        assert 0 < figures["peak_rss_mb"] < 4000
    assert r["get_batch_us"] and all(math.isfinite(us) and us > 0 for us in r["get_batch_us"].values())

    lines = proc.stdout.splitlines()
    assert lines[0] == "| measurement | 2 MB corpus | 1 MB corpus |"
    assert "| tokens, vocabulary, ids | " + f"{big['n_tokens']:,}, {big['vocab']}, uint16" in proc.stdout
    assert all(line.startswith("|") and line.endswith("|") for line in lines if line)
    assert "n/a" not in proc.stdout and "nan" not in proc.stdout


@pytest.mark.slow
def test_the_train_row_times_a_real_train_py_to_its_first_step(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SMALL_TEXT * 20, encoding="utf-8")
    t = bench._train(str(ROOT / "train.py"), corpus, tmp_path / "cache", tmp_path / "run", 6 << 30)
    assert t["status"] == 0 and t["error"] is None
    assert 0 < t["first_step_s"] <= t["total_s"] and 0 < t["peak_rss_mb"] < 4000
    assert (tmp_path / "run" / "ckpt.pt").exists()
    assert data.bench_report._first_step(t).startswith(f"{t['first_step_s']:.1f} s (20 steps: ")
