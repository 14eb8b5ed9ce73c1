"""python -m lab notes: the notes' worked example printed step by step. What it prints is checked against the numbers
the notes' cells print (literals here and in test_lab_notes.py), read back from the text as a reader would."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from conftest import ROOT
from notes_numbers import ALL_WEIGHTS
from test_lab_notes import (
    ALL_CONTEXTS,
    ALL_SCORES,
    CONTEXT_JOURNEY,
    SCORES_JOURNEY,
    SOFTMAX_JOURNEY,
    V1_SEED_123,
    V1_THEN_V2_SEED_789,
    V2_SEED_789,
)

from lab.__main__ import main as lab_main
from lab.walkthrough import walkthrough

NUMBER = re.compile(r"-?\d+\.\d{4}|-?inf")


def rows(text: str) -> list[list[str]]:
    """The numbers of each printed line, as printed (4 decimals)."""
    return [NUMBER.findall(line) for line in text.splitlines()]


def times_printed(text: str, *expected: list[float]) -> int:
    """How often the lines of expected appear in the text one after another, each line's numbers exactly."""
    want = [[f"{v:.4f}" if abs(v) != float("inf") else ("-inf" if v < 0 else "inf") for v in line]
            for line in expected]
    got = rows(text)
    return sum(got[i:i + len(want)] == want for i in range(len(got)))


def printed(text: str, *expected: list[float]) -> bool:
    return times_printed(text, *expected) > 0


def test_every_stage_prints_the_notes_numbers_for_journey(capsys):
    assert lab_main(["notes"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert printed(out, [0.43, 0.15, 0.89], [0.55, 0.87, 0.66])  # the inputs, Your and journey
    assert printed(out, SCORES_JOURNEY)
    # 001 In[19]-In[21]: divided by the sum, then softmax written out and torch's
    assert printed(out, [0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656], SOFTMAX_JOURNEY, SOFTMAX_JOURNEY)
    assert printed(out, CONTEXT_JOURNEY)
    assert printed(out, *ALL_SCORES) and printed(out, *ALL_WEIGHTS) and printed(out, *ALL_CONTEXTS)
    # 000 In[60]-In[71], seed 123: q^2, the scores and scaled weights, z^2
    assert printed(out, [0.4306, 1.4551])
    assert printed(out, [1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440], [0.1500, 0.2264, 0.2199, 0.1311, 0.0906,
                                                                            0.1820])
    assert printed(out, [0.3061, 0.8210])
    assert printed(out, *V1_SEED_123) and printed(out, *V2_SEED_789)
    assert printed(out, *[a + b for a, b in zip(V1_THEN_V2_SEED_789, V1_THEN_V2_SEED_789, strict=True)])
    # 001 In[58]-In[64]: the weights it masks, the masked scores, the causal weights; way (a) on the simple weights
    assert printed(out, [0.1827, 0.1681, 0.1682, 0.1577, 0.1660, 0.1573])
    assert printed(out, [0.2477, -float("inf"), *[-float("inf")] * 4], [0.1748, 0.2214, *[-float("inf")] * 4])
    causal = [[1.0, 0, 0, 0, 0, 0], [0.4918, 0.5082, 0, 0, 0, 0], [0.3261, 0.3371, 0.3368, 0, 0, 0],
              [0.2462, 0.2544, 0.2542, 0.2451, 0, 0], [0.1990, 0.2051, 0.2049, 0.1952, 0.1958, 0],
              [0.1657, 0.1707, 0.1706, 0.1636, 0.1638, 0.1655]]
    assert times_printed(out, *causal) == 2  # way (a) and way (b): the same weights
    assert printed(out, [1.0, 0, 0, 0, 0, 0], [0.3680, 0.6320, 0, 0, 0, 0], [0.2284, 0.3893, 0.3822, 0, 0, 0])
    # the stages in order, each naming the cells it reproduces
    titles = re.findall(r"^(\d+)\. ", out, flags=re.M)
    assert titles == [str(k) for k in range(1, 11)]
    assert "(000 In[60]-In[71])" in out and "(001 In[59]-In[64])" in out


def test_another_query_follows_that_word():
    out = walkthrough(4)
    assert "the query is x^4 (with)" in out
    # x^4's scores, weights and context vector: once in section 2, once more as row 4 of section 3's tables
    assert times_printed(out, ALL_SCORES[3]) == 2 and times_printed(out, ALL_CONTEXTS[3]) == 2
    assert times_printed(out, ALL_WEIGHTS[3]) == 3  # softmax written out and torch's, then the table's row
    assert times_printed(out, SCORES_JOURNEY) == 1  # journey's only in the table now
    # the cells of sections 2 and 4 print x^2's numbers: named for x^2 alone
    assert "In[18]" not in out and "In[60]-In[71]" not in out and "The notes follow x^2" in out
    assert "its row 4 is section 4's z^4" in out
    assert "In[18]" in walkthrough(2) and "The notes follow" not in walkthrough(2)


@pytest.mark.parametrize(("args", "says"), [(["--query", "0"], "--query must be from 1 to 6"),
                                            (["--query", "7"], "--query must be from 1 to 6"),
                                            (["--query", "9" * 4000], "got 9.999e+3999 (see"),  # not its digits
                                            (["--query", "-" + "9" * 4000], "got -9.999e+3999 (see"),
                                            (["--query", "two"], "invalid int value: 'two'"),
                                            (["--query"], "expected one argument"),
                                            (["--seed", "1"], "unrecognized arguments: --seed 1")])
def test_bad_arguments_are_one_line_and_status_2(args, says, capsys):
    with pytest.raises(SystemExit) as exited:
        lab_main(["notes", *args])
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: ") and says in err and "python -m lab notes --help" in err and len(err) < 200


def test_the_real_command_and_a_reader_that_goes_away():
    """The command as a user types it; then with its reader gone before it writes (`| head` that has read enough):
    no traceback."""
    whole = subprocess.run([sys.executable, "-m", "lab", "notes"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, check=False)
    assert whole.returncode == 0 and whole.stderr == "" and printed(whole.stdout, CONTEXT_JOURNEY)
    gone = subprocess.Popen([sys.executable, "-m", "lab", "notes"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    gone.stdout.close()  # long before it has imported torch and written anything
    assert gone.wait(timeout=120) == 0 and gone.stderr.read() == b""
    assert "notes" in subprocess.run([sys.executable, "-m", "lab", "--help"], cwd=ROOT, capture_output=True,
                                     text=True, timeout=60, check=False).stdout


# as a file too: the same guard in each
@pytest.mark.parametrize(("module", "as_file"), [("notes", False), ("heatmap", False), ("pictures", False),
                                               ("labels", False), ("seq2seq", False), ("sort_outputs", False),
                                               ("notes", True), ("pictures", True), ("labels", True),
                                               ("sort_outputs", True), ("sort_task", False), ("sort_task", True),
                                               ("notes_modules", False), ("notes_modules", True),
                                               ("sort_options", False), ("sort_options", True),
                                               ("colours", False), ("colours", True)])
def test_a_module_of_functions_run_alone_says_which_commands_run(module, as_file, tmp_path):
    """`python -m lab.notes` (and the others) ran nothing and exited 0, as if it had done what it was asked; run as a
    file, from another folder, it was a ModuleNotFoundError traceback. It is said before torch is imported (which
    took 3-4 s of each of these runs)."""
    how = [str(ROOT / "lab" / f"{module}.py")] if as_file else ["-m", f"lab.{module}"]
    done = subprocess.run([sys.executable, "-X", "importtime", *how], cwd=tmp_path if as_file else ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    imported = [line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    said = "".join(line + "\n" for line in done.stderr.splitlines() if not line.startswith("import time:"))
    assert done.returncode == 2 and done.stdout == "" and said.count("\n") == 1, said
    assert said.startswith(f"error: lab/{module}.py holds functions") and "python -m lab notes" in said
    assert "lab" in imported and not any(name.split(".")[0] in ("torch", "PIL") for name in imported)


@pytest.mark.parametrize("how", [["-m", "lab.walkthrough"], ["lab/walkthrough.py"], ["lab", "notes"]])
def test_the_walkthrough_module_runs_as_the_command_does(how, tmp_path):
    """As a module, or as the file or folder a user may hand to python (from another folder: the project's packages
    are found one folder up from the lab's)."""
    as_file = not how[0].startswith("-")
    if as_file:
        how = [str(ROOT / how[0]), *how[1:]]
    done = subprocess.run([sys.executable, *how, "--query", "4"], cwd=tmp_path if as_file else ROOT,
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0 and done.stdout == walkthrough(4), done.stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_while_the_walkthrough_is_computed_is_one_line(signum, monkeypatch, capsys):
    """SIGTERM in the fraction of a second it computes (after the modules have loaded) ended it without a word."""
    import lab.walkthrough
    from training.signals import StopSignals

    def computing(query):
        handler = signal.getsignal(signum)  # sent only to a handler of tinychar's: the default would end pytest
        assert isinstance(getattr(handler, "__self__", None), StopSignals), f"no tinychar handler for {signum}"
        signal.raise_signal(signum)
        return "never printed"

    monkeypatch.setattr(lab.walkthrough, "walkthrough", computing)
    assert lab_main(["notes"]) == 128 + signum
    out, err = capsys.readouterr()
    assert out == "" and err == f"\ninterrupted ({signal.Signals(signum).name})\n"
