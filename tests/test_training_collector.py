"""Python's cyclic garbage collector paused while train.py and sample.py start (training.collector): paused by the
programs, not by their main functions; taken up again, with what the start made frozen, where the work begins."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
from conftest import ROOT, tiny_overrides
from training_runs import call, train_main, write_corpus

import sample
from training import collector, compile_cache


@pytest.fixture
def paused(monkeypatch: pytest.MonkeyPatch):
    """The collector as train.py and sample.py leave it while they start; as it was, and nothing frozen, after."""
    was = gc.isenabled()
    monkeypatch.setattr(collector, "_paused", False)
    collector.pause()
    yield
    gc.unfreeze()
    if was:
        gc.enable()


def test_resume_freezes_what_the_start_made_and_collects_again(paused):
    assert not gc.isenabled() and collector._paused
    made = [[] for _ in range(1000)]  # objects the start still holds
    for inner in made:
        inner.append(inner)  # each a cycle the collector would scan
    collector.resume()
    assert gc.isenabled() and not collector._paused
    assert gc.get_freeze_count() >= len(made)
    frozen = gc.get_freeze_count()
    collector.resume()  # once only
    assert gc.get_freeze_count() == frozen


def test_a_collector_someone_else_turned_off_stays_off_and_nothing_is_frozen(monkeypatch):
    monkeypatch.setattr(collector, "_paused", False)
    was = gc.isenabled()
    gc.disable()
    try:
        collector.pause()
        collector.resume()
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        if was:
            gc.enable()
    collector.resume()  # not paused: nothing to do
    assert gc.isenabled() == was and gc.get_freeze_count() == 0


@pytest.mark.parametrize("script", ["train.py", "sample.py"])
def test_the_programs_pause_the_collector_and_their_main_functions_do_not(script, capsys):
    """Run as a program, each pauses the collector first thing (--help ends before any work begins, so it is still
    paused at the end); its main function, called here, leaves the caller's collector alone."""
    code = ("import gc, runpy, sys\n"
            f"sys.argv = [{script!r}, '--help']\n"
            "try:\n"
            f"    runpy.run_path({script!r}, run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "print('collecting' if gc.isenabled() else 'paused', file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "paused", done.stderr
    main = train_main if script == "train.py" else sample.main
    assert gc.isenabled() and gc.get_freeze_count() == 0
    code, out, _ = call(main, ["--help"], capsys)
    assert code == 0 and "usage" in out
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_the_run_and_the_sampling_take_the_collector_up_again_where_their_work_begins(paused, tmp_path, capsys):
    out = tmp_path / "run"
    args = tiny_overrides(write_corpus(tmp_path), out, **{"train.max_iters": 2, "train.eval_interval": 2,
                                                           "train.sample_chars": 0, "train.tensorboard": "false"})
    code, _, err = call(train_main, args, capsys)
    assert code == 0, err
    assert gc.isenabled() and gc.get_freeze_count() > 0
    gc.unfreeze()
    collector.pause()
    code, text, err = call(sample.main, ["--out-dir", str(out), "--device", "cpu", "--max-new-tokens", "5"], capsys)
    assert code == 0 and text, err
    assert gc.isenabled() and gc.get_freeze_count() > 0


def test_a_compile_takes_the_collector_up_again_before_it_compiles(paused):
    """The compile itself makes cyclic garbage (its graphs), so the collector runs while it compiles: taken up again
    once the compiler's modules have loaded (here, the session's compile cache, as every test's)."""
    compile_cache.prepare_compile()
    assert gc.isenabled() and gc.get_freeze_count() > 0
