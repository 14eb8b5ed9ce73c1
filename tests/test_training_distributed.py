"""training/distributed.py: data-parallel training under torchrun (gloo on the CPU): two processes with half the
batch each take the same steps as one with all of it; a two-process run stops on Ctrl-C with a checkpoint, resumes
exactly, and hands its checkpoint to sample.py and to a one-process run (and back); a bad data path ends every process
with one line; and the pieces of training/distributed.py on their own."""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SMALL_TEXT, tiny_overrides, train_small_run
from test_train import bitwise_equal, child_env, one_error_line, weights

import sample
import train
import training.distributed
import training.loop
from configs import to_dict
from configs.userinput import shown
from data import get_batch
from model import load_checkpoint
from training.checkpoints import check_resume_config
from training.config import TrainConfig, load_config
from training.devices import DeviceError
from training.distributed import (
    check_master_addr,
    check_same_run,
    cores_here,
    derived_seed,
    join_wait_line,
    oversubscribed,
    resolve_backend,
    threads_per_process,
)
from training.launch import Launch, LaunchError, launch_from_env

TINY = str(ROOT / "configs" / "tiny.yaml")
# A launch starts three interpreters (torchrun and two workers) that each import torch: seconds, not minutes. A run
# that hangs (a process waiting for a partner that has gone) is what this limit catches.
TIMEOUT = 90
# As in test_train: a schedule that does not depend on max_iters, and dropout so that the torch RNG matters.
RESUME_KEYS = {"model.dropout": 0.1, "train.lr_decay_iters": 20}


def torchrun_command(*args: str, script: str = "train.py", nproc: int = 2) -> list[str]:
    # --standalone: a rendezvous on a port the system picks, so launches never clash with each other
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script, *args]


def torchrun(*args: str, script: str = "train.py") -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_command(*args, script=script), cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=TIMEOUT, check=False)


def two_processes(folder: Path, *args: str, rank1: tuple[str, ...] = (), script: str = "train.py"
                  ) -> list[tuple[int, str]]:
    """script in two processes given the environment torchrun gives its workers (ranks, world size, where rank 0
    listens), without torchrun: (exit status, stdout and stderr) of rank 0 and rank 1, rank 1's command line with
    rank1 added, as when two machines of a run were given different ones. For the tests whose subject is what the
    processes do together, not torchrun's launch (kept real for signals, exit reports and resume lines): train.py's
    processes are forks of the tests' zygote (tests/zygote.py), which has imported torch. Two that compare their
    settings and stop took 0.2-0.3 s of CPU in all, under torchrun 5.5-5.9 s: torchrun's own start and its two
    workers' imports of torch (2-core AMD EPYC (Zen 3, AVX2), 2026-12-05)."""
    port = str(free_port())
    procs, logs = [], [folder / f"rank{rank}.txt" for rank in (0, 1)]
    try:
        for rank, log in enumerate(logs):
            env = {**child_env(), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            with log.open("w") as f:
                procs.append(subprocess.Popen([sys.executable, script, *args, *(rank1 if rank else ())], cwd=ROOT,
                                              env=env, stdout=f, stderr=subprocess.STDOUT))
        codes = [proc.wait(timeout=TIMEOUT) for proc in procs]  # a process waiting for a partner gone: a failure
    finally:  # none left training behind
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [(code, log.read_text(encoding="utf-8")) for code, log in zip(codes, logs, strict=True)]


def our_traceback(output: str) -> bool:
    """Whether a traceback passes through tinychar's own code (torchrun prints its own when a worker fails)."""
    return bool(re.search(r'File "[^"]*/(train|sample)\.py"|File "[^"]*/(model|data|configs)/', output))


def write_corpus(folder: Path) -> Path:
    path = folder / "corpus.txt"
    path.write_text(SMALL_TEXT, encoding="utf-8")
    return path


def quiet_main(args: list[str]) -> tuple[int, str]:
    """train.main in this process: (exit status, stdout)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = train.main(args, progress=False)
    return code, out.getvalue()


# ------------------------------------------------------------------------------- the same optimizer steps


def fixed_batches(pool: torch.Tensor, rank: int, world: int) -> Callable:
    """A stand-in for get_batch: micro-batch m of every step is pool[m] (B windows of T + 1 ids), of which process
    rank of world takes its own consecutive B / world rows. Other sizes (evaluation) get real batches."""
    accum, batch, _ = pool.shape
    calls = [0]

    def draw(data, block_size, batch_size, generator, device="cpu"):
        if batch_size != batch // world:
            return get_batch(data, block_size, batch_size, generator, device)
        micro = pool[calls[0] % accum]
        calls[0] += 1
        mine = micro[rank * batch_size:(rank + 1) * batch_size]
        return mine[:, :-1].contiguous().to(device), mine[:, 1:].contiguous().to(device)

    return draw


def batch_pool(accum: int, batch: int, block_size: int) -> torch.Tensor:
    vocab = len(set(SMALL_TEXT))
    return torch.randint(vocab, (accum, batch, block_size + 1), generator=torch.Generator().manual_seed(0))


# Runs train.py as a process of a two-process run with get_batch replaced by fixed_batches (argv: accumulation,
# global batch, block size, then train.py's arguments).
FIXED_BATCHES = """
import os, sys
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests")]
import train
import training.loop
from test_training_distributed import batch_pool, fixed_batches
from training.streams import leave_now

accum, batch, block = (int(a) for a in sys.argv[1:4])
pool = batch_pool(accum, batch, block)
training.loop.get_batch = fixed_batches(pool, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
# left as train.py leaves a torchrun process: sys.exit's interpreter shutdown aborted in torch's C++ teardown once
leave_now(train.main(sys.argv[4:], progress=False))
"""

# No biases: the key projection's bias has a gradient of exactly zero in theory (adding one number to every score of a
# row leaves its softmax alone), so in practice rounding noise, which Adam scales up to a full step either way.
# A modest learning rate: Adam divides each gradient by its own size, so rounding differences in small gradients
# move the weights by a fraction of the rate.
EQUIVALENCE_KEYS = {"model.bias": "false", "train.learning_rate": 1e-3, "train.min_lr": 1e-4, "train.max_iters": 3,
                    "train.warmup_iters": 0, "train.eval_interval": 3, "train.eval_iters": 1,
                    "train.grad_accum_steps": 2, "train.tensorboard": "false"}


@pytest.mark.slow
def test_two_processes_with_half_the_batch_take_the_same_steps_as_one_with_all_of_it(tmp_path, monkeypatch):
    batch, block, accum = 8, 8, EQUIVALENCE_KEYS["train.grad_accum_steps"]
    corpus = write_corpus(tmp_path)
    script = tmp_path / "fixed_batches.py"
    script.write_text(FIXED_BATCHES, encoding="utf-8")
    two = tiny_overrides(corpus, tmp_path / "two", **EQUIVALENCE_KEYS, **{"train.batch_size": batch // 2})
    # two processes without torchrun's own (two_processes): the subject is their sums, not the launch
    (code, stdout), (rank1_code, rank1_out) = two_processes(tmp_path, str(accum), str(batch), str(block), "--config",
                                                            TINY, *two, script=str(script))
    assert code == rank1_code == 0, stdout + rank1_out
    assert "global batch: 2 processes x 4 sequences x 2 micro-batches = 16 sequences (128 tokens)" in stdout

    pool = batch_pool(accum, batch, block)
    monkeypatch.setattr(training.loop, "get_batch", fixed_batches(pool, 0, 1))
    one = tiny_overrides(corpus, tmp_path / "one", **EQUIVALENCE_KEYS, **{"train.batch_size": batch})
    assert quiet_main(["--config", TINY, *one])[0] == 0
    # the control: rank 0's half alone, as if the other process's gradients never arrived
    monkeypatch.setattr(training.loop, "get_batch", fixed_batches(pool, 0, 2))
    half = tiny_overrides(corpus, tmp_path / "half", **EQUIVALENCE_KEYS, **{"train.batch_size": batch // 2})
    assert quiet_main(["--config", TINY, *half])[0] == 0

    two_w, one_w, half_w = (weights(tmp_path / name / "ckpt.pt") for name in ("two", "one", "half"))
    assert two_w.keys() == one_w.keys()
    for name in one_w:
        torch.testing.assert_close(two_w[name], one_w[name], rtol=0, atol=1e-6, msg=name)
    assert max((half_w[k] - one_w[k]).abs().max().item() for k in one_w) > 1e-4


# ------------------------------------------------------------------- Ctrl-C, resume, sample, 1 <-> 2 processes


def two_processes_at_step_5(base: Path, out: Path, log: Path, **keys: object) -> subprocess.Popen:
    """torchrun training two processes for a long time into out, its output in log; returned at its step 5."""
    args = ["--config", TINY, *tiny_overrides(write_corpus(base), out, **keys, **{
        "train.max_iters": 100_000, "train.log_interval": 1, "train.eval_interval": 10})]
    with log.open("w") as f:
        proc = subprocess.Popen(torchrun_command(*args), cwd=ROOT, env=child_env(), stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + TIMEOUT
    while not re.search(r"^step 5/", log.read_text(encoding="utf-8"), re.MULTILINE):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text(encoding="utf-8")
        time.sleep(0.01)
    return proc


@pytest.fixture(scope="module")
def stopped_two_process_run(tmp_path_factory) -> tuple[Path, int, str]:
    """A two-process run stopped by Ctrl-C to torchrun: (out_dir, the step it stopped at, its output)."""
    base = tmp_path_factory.mktemp("two")
    out, log = base / "out", base / "log.txt"
    proc = two_processes_at_step_5(base, out, log, **RESUME_KEYS)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C at the terminal does; torchrun passes it on to every process
    try:
        proc.wait(timeout=TIMEOUT)
    finally:
        proc.kill()
    text = log.read_text(encoding="utf-8")
    stops = [line for line in text.splitlines() if line.startswith("stopped at step")]
    assert len(stops) == 1, text
    step = int(re.match(r"stopped at step (\d+):", stops[0])[1])
    return out, step, text


@pytest.mark.slow
def test_workers_whose_torchrun_was_killed_stop_with_a_checkpoint(tmp_path):
    """kill -9 to torchrun left both workers training to the end (43 s of 400 steps, measured), each in a session of
    its own that a Ctrl-C at the terminal no longer reached, holding out_dir's lock all the while."""
    out, log = tmp_path / "out", tmp_path / "log.txt"
    proc = two_processes_at_step_5(tmp_path, out, log)
    workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True,
                                              check=False).stdout.split()]
    assert len(workers) == 2, log.read_text(encoding="utf-8")
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    try:
        while any(os.path.exists(f"/proc/{pid}") and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
                  for pid in workers):
            assert time.monotonic() < deadline, log.read_text(encoding="utf-8")
            time.sleep(0.05)
    finally:  # a failure leaves no worker training behind
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text(encoding="utf-8")
    stops = re.findall(r"^stopped at step (\d+): saved", text, re.MULTILINE)
    assert len(stops) == 1 and load_checkpoint(out / "ckpt.pt")["step"] == int(stops[0]), text
    assert not our_traceback(text), text


@pytest.mark.slow
def test_ctrl_c_stops_every_process_at_one_step_with_one_checkpoint_and_a_resume_line(stopped_two_process_run):
    out, step, text = stopped_two_process_run
    assert step >= 5 and f"step {step}/" in text and f"step {step + 1}/" not in text  # the last step finished
    assert f"continue with: torchrun --standalone --nproc-per-node 2 train.py --out-dir {out} --resume" in text
    assert not our_traceback(text), text
    raw = load_checkpoint(out / "ckpt.pt")
    assert raw["step"] == step and raw["world_size"] == 2
    batches = [state["batches"] for state in raw["rng"]["per_rank"]]
    assert len(batches) == 2 and not torch.equal(*batches)  # each process drew batches of its own
    assert torch.equal(raw["rng"]["batches"], batches[0])
    assert len(list(out.glob("events.out.tfevents.*"))) == 1  # rank 0 alone writes TensorBoard logs
    assert not list(out.glob(".*.tmp"))


@pytest.mark.slow
def test_a_two_process_run_resumes_exactly_and_its_checkpoint_serves_sample_py_and_one_process(
    stopped_two_process_run, tmp_path, capsys
):
    stopped, step, _ = stopped_two_process_run
    out = tmp_path / "resumed"
    out.mkdir()
    for name in ("ckpt.pt", "config.yaml"):  # the module's run stays as it stopped for the other tests
        (out / name).write_bytes((stopped / name).read_bytes())
    end = step + 5
    resumed = torchrun("--resume", "--out-dir", str(out), f"train.max_iters={end}")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming '{shown(out / 'ckpt.pt')}' at step {step}" in resumed.stdout
    assert resumed.stdout.count(f"done: step {end}") == 1  # rank 0 alone reports
    assert "batch order differs" not in resumed.stdout

    # The same run without a stop, from start to end in one go (the same configs/tiny.yaml, as a user would); its two
    # processes without torchrun (two_processes), whose launch the resume above has just been.
    straight = tmp_path / "straight"
    args = ["--config", TINY, *tiny_overrides(stopped.parent / "corpus.txt", straight, **RESUME_KEYS, **{
        "train.max_iters": end, "train.log_interval": 1, "train.eval_interval": 10})]
    (code, stdout), (rank1_code, rank1_out) = two_processes(tmp_path, *args)
    assert code == rank1_code == 0, stdout + rank1_out
    global_batch = "global batch: 2 processes x 8 sequences x 1 micro-batch = 16 sequences (128 tokens) per step"
    assert global_batch in stdout
    assert bitwise_equal(weights(out / "ckpt.pt"), weights(straight / "ckpt.pt"))

    capsys.readouterr()
    assert sample.main(["--out-dir", str(straight), "--device", "cpu", "--prompt", "First", "--max-new-tokens",
                        "30"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("First") and text.endswith("\n") and len(text) == len("First") + 30 + 1

    # One process continues what two saved: the same weights and optimizer, batches drawn afresh, said in one line.
    code, stdout = quiet_main(["--resume", "--out-dir", str(out), f"train.max_iters={end + 5}"])
    assert code == 0
    assert "resume: the checkpoint was saved by 2 processes and this run has 1" in stdout
    assert "the global batch goes from 16 to 8 sequences a step (train.batch_size and" in stdout  # said: it halves
    raw = load_checkpoint(out / "ckpt.pt")
    assert raw["step"] == end + 5 and raw["world_size"] == 1 and "per_rank" not in raw["rng"]


@pytest.mark.slow
def test_two_processes_continue_a_one_process_run_and_a_bad_data_path_ends_both_with_one_line(tmp_path):
    out = tmp_path / "one"
    corpus = write_corpus(tmp_path)
    assert quiet_main(["--config", TINY, *tiny_overrides(corpus, out, **{"train.max_iters": 10})])[0] == 0
    # two processes without torchrun (two_processes): torchrun's launch is the bad data path's below
    (code, stdout), (rank1_code, rank1_out) = two_processes(tmp_path, "--resume", "--out-dir", str(out),
                                                            "train.max_iters=20")
    assert code == rank1_code == 0, stdout + rank1_out
    assert "resume: the checkpoint was saved by 1 process and this run has 2" in stdout
    raw = load_checkpoint(out / "ckpt.pt")
    assert raw["step"] == 20 and raw["world_size"] == 2

    started = time.monotonic()
    bad = torchrun("--config", TINY, *tiny_overrides(tmp_path / "corpsu.txt", tmp_path / "bad"))
    output = bad.stdout + bad.stderr
    assert bad.returncode != 0
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    missing = f"error: data.path: no such file '{shown(tmp_path / 'corpsu.txt')}'; did you mean '{shown(corpus)}'?"
    assert errors == [missing], output
    # every process ended, none hung: torchrun's report of its processes
    assert re.findall(r"^\s*exitcode\s+: (\d+)", output, re.MULTILINE) == ["2", "2"], output
    assert not our_traceback(output), output
    assert not (tmp_path / "bad").exists()
    assert time.monotonic() - started < 30


# ------------------------------------------------------------- processes that were given different things


@pytest.mark.slow
@pytest.mark.parametrize("case", ["setting", "text", "command line", "help"])
def test_processes_given_different_settings_text_or_command_lines_all_stop_with_one_line(tmp_path, case):
    corpus = write_corpus(tmp_path)
    other = tmp_path / "other.txt"  # the same characters in another order: the same vocabulary, another text
    other.write_text(SMALL_TEXT[::-1], encoding="utf-8")
    out = tmp_path / "out"
    rank1, expected = {
        "setting": (["train.learning_rate=3e-3"], "error: the processes of this run were given different settings: "
                    "train.learning_rate is 0.001 in rank 0 and 0.003 in rank 1; give every process the same command "
                    "line and config file"),
        "text": ([f"data.path={other}"], "error: the processes of this run read different text: data.path "
                 "'...other.txt' in rank 1 is not the text of data.path '...corpus.txt' in rank 0; give every machine "
                 "the same corpus"),
        "command line": (["--resume", "--overwrite"], "error: rank 1: --resume and --overwrite contradict each other; "
                         "choose one (see train.py --help)"),
        # it printed nothing and left at once, and rank 0 waited for it for its 30-minute timeout
        "help": (["--help"], "error: rank 1: --help was given to this process and not to rank 0, which prints it; "
                 "give every process the same command line"),
    }[case]
    # out_dir and the thread count may differ between machines. Two processes without torchrun (two_processes):
    # the subject is what they tell each other; torchrun's report of workers that end with 2 is
    # test_two_processes_continue_a_one_process_run_and_a_bad_data_path_ends_both_with_one_line's.
    ranks = two_processes(tmp_path, "--config", TINY, *tiny_overrides(corpus, out, **{"train.learning_rate": 1e-3}),
                          rank1=("train.threads=1", f"out_dir={tmp_path / 'elsewhere'}", *rank1))
    output = "".join(text for _, text in ranks)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    # long paths are quoted with their middle cut out
    assert re.fullmatch(re.escape(expected).replace(r"'\.\.\.", "'.*"), errors[0]), output
    assert [code for code, _ in ranks] == [2, 2], output  # each ended by itself, neither waits for the other
    assert not our_traceback(output), output
    assert not out.exists()  # refused before rank 0 claimed out_dir


def test_the_settings_that_must_match_are_compared_and_the_per_machine_ones_are_not(tmp_path, monkeypatch):
    cfg = load_config(TINY, tiny_overrides(tmp_path / "corpus.txt", tmp_path / "out"))
    launch = Launch(rank=0, world_size=2, local_world_size=2, torchrun=True)

    def check(other_cfg, *, resume: bool = False, fingerprint: str = "f0") -> None:
        theirs = ({**training.distributed.settings_of(other_cfg), "--resume": resume}, fingerprint, None)
        monkeypatch.setattr(training.distributed, "all_gather", lambda mine: [mine, theirs])
        check_same_run(launch, cfg, False, "f0")

    per_machine = ["out_dir=/elsewhere", "data.path=/elsewhere/corpus.txt", "data.cache_dir=/cache", "train.threads=3",
                   "train.device=cpu", "train.tensorboard=false", "train.log_interval=7", "train.sample_chars=0"]
    check(load_config(TINY, tiny_overrides(tmp_path / "corpus.txt", tmp_path / "out") + per_machine))
    for override in ("model.n_embd=32", "seed=1", "train.max_iters=99", "train.learning_rate=0.5",
                     "data.val_fraction=0.5", "train.compile=true"):
        key = override.split("=")[0]
        with pytest.raises(LaunchError, match=f"different settings: {re.escape(key)} is .* in rank 1;"):
            check(load_config(TINY, tiny_overrides(tmp_path / "corpus.txt", tmp_path / "out") + [override]))
    with pytest.raises(LaunchError, match="--resume is False in rank 0 and True in rank 1"):
        check(cfg, resume=True)
    with pytest.raises(LaunchError, match="read different text"):
        check(cfg, fingerprint="f1")

    # A resume: each process reads its own out_dir's ckpt.pt, which on another machine may be an older copy (rank 0
    # resumed at step 100, rank 1 at step 50, their collectives paired wrongly, and the run said it was done)
    def resume_from(mine: dict, theirs: dict) -> None:
        monkeypatch.setattr(training.distributed, "all_gather", lambda ours: [
            ours, ({**training.distributed.settings_of(cfg), "--resume": True}, "f0", (theirs["step"],
                                                                                     theirs["best_val_loss"]))])
        check_same_run(launch, cfg, True, "f0", mine)

    resume_from({"step": 100, "best_val_loss": 1.5}, {"step": 100, "best_val_loss": 1.5})
    with pytest.raises(LaunchError, match=re.escape(
            "resume from different checkpoints: step 100 in rank 0's out_dir/ckpt.pt, step 50 in rank 1's; copy rank "
            "0's ckpt.pt to every machine's out_dir, or give the processes one shared out_dir")):
        resume_from({"step": 100, "best_val_loss": 1.5}, {"step": 50, "best_val_loss": 1.7})
    with pytest.raises(LaunchError, match=r"step 100 in rank 1's \(best losses 1.5 and 1.25\); copy"):
        resume_from({"step": 100, "best_val_loss": 1.5}, {"step": 100, "best_val_loss": 1.25})
    monkeypatch.setattr(training.distributed, "all_gather", lambda mine: pytest.fail("a lone process gathers"))
    check_same_run(Launch(), cfg, False, "f0")


def test_a_plain_run_in_a_stale_torchrun_environment_says_what_it_waits_for_and_stops_on_sigterm(tmp_path):
    """RANK and WORLD_SIZE left over from another shell: the join waits for a partner that never comes. It says so,
    and SIGTERM (or Ctrl-C) ends the wait at once, where it used to be held back for the 30-minute timeout."""
    port = free_port()
    env = {**child_env(), "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.pop("TORCHELASTIC_RUN_ID", None)
    err = tmp_path / "stderr.txt"
    args = tiny_overrides(write_corpus(tmp_path), tmp_path / "out")
    with err.open("w") as f:
        proc = subprocess.Popen([sys.executable, "train.py", "--config", TINY, *args], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=f)
    try:
        deadline = time.monotonic() + TIMEOUT
        while "waiting for" not in err.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 128 + signal.SIGTERM
    assert err.read_text().splitlines() == [
        f"rank 0: waiting for the other 1 process(es) of the run to join at 127.0.0.1:{port} (RANK=0, WORLD_SIZE=2); "
        f"Ctrl-C stops; to train in one process, unset RANK and WORLD_SIZE",
        "interrupted (SIGTERM) before training started; no checkpoint was saved"]
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------- one torchrun process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_torchrun_launch_of_one_process_trains_exactly_as_a_plain_run(tmp_path, monkeypatch):
    """The whole torchrun path (process group, DDP, the per-step agreement, gathered RNG states) in this process,
    as a group of one: it must change nothing about the run."""
    corpus = write_corpus(tmp_path)
    # one thread for both: a torchrun process would otherwise take every core, and split its sums differently
    keys = {**RESUME_KEYS, "train.grad_accum_steps": 2, "train.tensorboard": "false", "train.threads": 1}
    code, plain_out = quiet_main(["--config", TINY, *tiny_overrides(corpus, tmp_path / "plain", **keys)])
    assert code == 0
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    wrapped = []
    real_data_parallel = training.distributed.data_parallel

    def data_parallel(model, device):
        wrapped.append(real_data_parallel(model, device))
        return wrapped[-1]

    monkeypatch.setattr(training.distributed, "data_parallel", data_parallel)
    code, group_out = quiet_main(["--config", TINY, *tiny_overrides(corpus, tmp_path / "group", **keys)])
    assert code == 0
    assert len(wrapped) == 1 and isinstance(wrapped[0], torch.nn.parallel.DistributedDataParallel)
    assert not torch.distributed.is_initialized()  # torn down on the way out
    assert bitwise_equal(weights(tmp_path / "plain" / "ckpt.pt"), weights(tmp_path / "group" / "ckpt.pt"))
    assert "global batch: 1 process x 8 sequences x 2 micro-batches = 16 sequences (128 tokens) per step" in group_out
    losses = [re.findall(r"loss [0-9.]+", text) for text in (plain_out, group_out)]
    assert losses[0] == losses[1] and losses[0]


def test_a_one_process_checkpoint_keeps_its_format(tmp_path):
    out = tmp_path / "out"
    overrides = tiny_overrides(write_corpus(tmp_path), out, **{"train.max_iters": 3})
    assert quiet_main(["--config", TINY, *overrides])[0] == 0
    raw = load_checkpoint(out / "ckpt.pt")
    assert raw["world_size"] == 1 and set(raw["rng"]) <= {"torch", "batches", "cuda"}


# ------------------------------------------------------------------------------------ the pieces on their own


def test_launch_comes_from_torchruns_variables():
    assert launch_from_env({}) == Launch()
    assert Launch().main and not Launch().torchrun
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    launch = launch_from_env(env)
    assert launch == Launch(rank=3, world_size=4, local_rank=1, local_world_size=2, torchrun=True)
    assert not launch.main
    with pytest.raises(LaunchError, match="not whole numbers"):
        launch_from_env({**env, "RANK": "three"})
    # one without the other: a process started by hand as rank 1 of 2 trained as a rank 0 of its own
    for alone, says in (({"RANK": "1"}, "RANK='1' is set but WORLD_SIZE is not; start the run with torchrun"),
                        ({"WORLD_SIZE": "2"}, "WORLD_SIZE='2' is set but RANK is not; start the run with torchrun")):
        with pytest.raises(LaunchError, match=says):
            launch_from_env(alone)
    assert launch_from_env({"WORLD_SIZE": "1"}) == launch_from_env({"RANK": "0"}) == Launch()  # one process anyway
    with pytest.raises(LaunchError, match="inconsistent"):
        launch_from_env({**env, "RANK": "4"})
    for world in (2**31, 10**20):  # a TypeError traceback from the rendezvous's store, which counts in a C int
        with pytest.raises(LaunchError, match=f"WORLD_SIZE={world} is more processes than torch.distributed takes"):
            launch_from_env({**env, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": "2"})
    # values of any length are quoted cut short: the whole of them made lines of 100,000 characters
    for rank in ("x" * 100_000, "-" + "9" * 4000):
        with pytest.raises(LaunchError) as refused:
            launch_from_env({**env, "RANK": rank})
        assert len(str(refused.value)) < 400 and "..." in str(refused.value)
    waiting = join_wait_line(launch, {"MASTER_ADDR": "h" * 5000, "MASTER_PORT": "1" * 5000})
    assert len(waiting) < 400 and waiting.count("...") == 2


def test_a_bad_torchrun_environment_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.main(["--help"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: inconsistent torchrun environment: RANK=2, WORLD_SIZE=2")


UNRESOLVED = ("MASTER_ADDR='no.such.host.invalid' is not a host name or address this machine can resolve (Name or "
              "service not known); set MASTER_ADDR to the address of the machine of rank 0, or unset RANK and "
              "WORLD_SIZE to run one process")


def names_that_end_in_invalid_do_not_resolve(monkeypatch) -> None:
    """RFC 6761: a name under .invalid never resolves. Said here, without asking a name server (the tests reach no
    other machine); addresses such as 127.0.0.1 still resolve, which needs no network."""
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if str(host).endswith(".invalid"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_a_master_addr_that_does_not_resolve_is_refused_and_one_that_does_is_not(monkeypatch):
    names_that_end_in_invalid_do_not_resolve(monkeypatch)
    with pytest.raises(LaunchError) as info:
        check_master_addr({"MASTER_ADDR": "no.such.host.invalid", "MASTER_PORT": "29500"})
    assert str(info.value) == UNRESOLVED
    with pytest.raises(LaunchError, match=r"^MASTER_ADDR='a+\.\.\.a+\.com' is not a host name .*label"):
        check_master_addr({"MASTER_ADDR": "a" * 64 + ".com"})  # longer than a DNS label may be: refused unasked
    check_master_addr({"MASTER_ADDR": "127.0.0.1"})
    check_master_addr({})  # unset: init_process_group says so itself, in one line too


@pytest.mark.parametrize("port", ["abc", "", "70000", "-1", "29 500"])
def test_a_master_port_that_is_no_port_number_is_refused_naming_it(port):
    # "cannot join the other 1 process(es) ... (invalid literal for int() with base 10: 'abc')", naming no variable
    with pytest.raises(LaunchError) as info:
        check_master_addr({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
    assert str(info.value) == (f"MASTER_PORT={port!r} is not a port number (0-65535); set MASTER_PORT to the port "
                               "rank 0 listens on, or unset RANK and WORLD_SIZE to run one process")
    check_master_addr({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})


def test_a_run_whose_master_addr_does_not_resolve_stops_at_once_in_one_line(tmp_path, monkeypatch, capsys):
    """It used to wait in the rendezvous for its 30-minute timeout, a name-resolution warning every few seconds."""
    names_that_end_in_invalid_do_not_resolve(monkeypatch)
    # Were the name left to the rendezvous, the test fails after these seconds instead of waiting for half an hour.
    monkeypatch.setattr(training.distributed, "TIMEOUT", datetime.timedelta(seconds=5))
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "no.such.host.invalid", "MASTER_PORT": str(free_port())}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    out = tmp_path / "out"
    code = train.main(["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out)], progress=False)
    assert (code, capsys.readouterr().err) == (2, f"error: {UNRESOLVED}\n")
    assert not out.exists() and not torch.distributed.is_initialized()
    # Another rank, on a machine that cannot reach rank 0's, says so there, where the cause is: it ended in silence
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    code = train.main(["--config", TINY, *tiny_overrides(write_corpus(tmp_path), out)], progress=False)
    assert (code, capsys.readouterr().err) == (2, f"error: rank 1: {UNRESOLVED}\n")
    assert not out.exists() and not torch.distributed.is_initialized()


def test_derived_seeds_differ_by_rank_stream_and_step_and_suit_a_generator():
    seeds = {derived_seed(1337, stream, rank, *step) for stream in range(3) for rank in range(8)
             for step in [(), (0,), (100,)]}
    assert len(seeds) == 3 * 8 * 3
    assert derived_seed(1337, 0, 1) == derived_seed(1337, 0, 1) != derived_seed(1338, 0, 1)
    for seed in (0, -1, 2**63 - 1, -(2**63)):
        value = derived_seed(seed, 2, 5)
        assert 0 <= value < 2**64
        torch.Generator().manual_seed(value)


def test_the_backend_follows_the_device_and_nccl_needs_cuda():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "gloo" and resolve_backend("gloo", cpu) == "gloo"
    assert resolve_backend("auto", torch.device("cuda", 0)) == "nccl"
    with pytest.raises(DeviceError, match="train.backend=nccl needs CUDA"):
        resolve_backend("nccl", cpu)


def test_processes_times_threads_never_exceed_the_cores():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for processes in (1, 2, 3, cores, 2 * cores):
        threads = threads_per_process(Launch(world_size=processes, local_world_size=processes, torchrun=True))
        assert threads >= 1 and (processes * threads <= cores or threads == 1)
    assert threads_per_process(Launch(world_size=1, local_world_size=1, torchrun=True)) == cores


def test_more_threads_than_cores_is_one_note_naming_the_setting_that_fits(tmp_path, capsys):
    cores = cores_here()
    alone, pair = Launch(), Launch(world_size=2, local_world_size=2, torchrun=True)
    assert oversubscribed(0, alone) is None and oversubscribed(cores, alone) is None
    assert oversubscribed(0, pair) is None and oversubscribed(max(1, cores // 2), pair) is None
    more = cores + 1
    assert oversubscribed(more, alone) == (
        f"note: train.threads={more} on {cores} core{'s' if cores > 1 else ''}: threads beyond the cores take turns "
        f"and slow every step; train.threads=0 takes one a core")
    assert oversubscribed(cores, pair) == (
        f"note: train.threads={cores} x 2 processes = {2 * cores} threads on {cores} core{'s' if cores > 1 else ''}: "
        f"threads beyond the cores take turns and slow every step; train.threads=0 shares the cores out among them")
    before = torch.get_num_threads()
    try:
        train_small_run(tmp_path, **{"train.threads": more, "train.max_iters": 2})
        (tmp_path / "fits").mkdir()
    finally:
        torch.set_num_threads(before)  # the run set torch's threads for this whole worker process
    assert capsys.readouterr().out.count(f"note: train.threads={more} on {cores} core") == 1
    train_small_run(tmp_path / "fits", **{"train.threads": 1, "train.max_iters": 2})
    assert "threads beyond the cores" not in capsys.readouterr().out


def test_more_than_four_threads_a_core_is_refused_before_the_run_touches_anything(tmp_path, capsys):
    """train.threads=4096 on 2 cores trained about 100 times slower, and under a memory limit the threads' stacks took
    it all: the run ended in a MemoryError traceback while reading its corpus."""
    cores = cores_here()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SMALL_TEXT, encoding="utf-8")
    before = torch.get_num_threads()
    for threads in (4 * cores + 1, 4096):
        args = tiny_overrides(corpus, tmp_path / "out", **{"train.threads": threads, "train.max_iters": 2})
        assert train.main(["--config", TINY, *args], progress=False) == 2
        line = one_error_line(capsys.readouterr().err)
        assert line == (f"error: train.threads={threads} is more than 4 threads for each of the {cores} "
                        f"core{'s' if cores > 1 else ''} this process may use; threads beyond the cores take turns "
                        f"and slow every step: train.threads=0 takes one a core, or give at most {4 * cores}")
        assert not (tmp_path / "out").exists() and torch.get_num_threads() == before


def test_train_backend_is_checked_and_may_change_on_resume(tmp_path, capsys):
    with pytest.raises(ValueError, match="train.backend must be one of auto, gloo, nccl; got 'mpi'"):
        TrainConfig(backend="mpi")
    saved = to_dict(load_config(TINY, []))
    assert check_resume_config(saved, load_config(TINY, ["train.backend=gloo"])) == [
        "train.backend: 'auto' -> 'gloo'"]
    # what orders a step's sums otherwise is allowed (on one thread instead of two, the weights of a 20-step resume
    # differed by up to 3.5e-5 from the straight run's); whether it does, the runner says once the setup is settled
    assert check_resume_config(saved, load_config(TINY, ["train.threads=1", "train.compile=false"])) == [
        "train.compile: 'auto' -> 'false'", "train.threads: 0 -> 1"]
    assert train.main(["train.backend=nccl2", "--out-dir", str(tmp_path / "x")], progress=False) == 2
    assert "train.backend must be one of" in capsys.readouterr().err


def test_one_of_rank_and_world_size_empty_or_meaning_one_process_passes():
    # an empty RANK, or 00, ran as one process before the check and still does
    for alone in ({"RANK": ""}, {"RANK": "00"}, {"WORLD_SIZE": " 1 "}, {"WORLD_SIZE": ""}):
        assert launch_from_env(alone) == Launch()


def test_a_later_rank_with_nothing_to_resume_is_told_where_rank_0_s_checkpoint_is(tmp_path, monkeypatch):
    # On another machine, out_dir holds no copy of the ckpt.pt rank 0 wrote: "start the run without --resume", which
    # rank 0 then refuses (its folder holds a run), and --overwrite would throw the run away
    from configs.errors import UsageError
    from configs.userinput import shown
    from training.resuming import resume_target

    tmp_path.joinpath("out").mkdir()
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}
    for rank, says in (("1", "every process of a run reads its out_dir's ckpt.pt, and rank 0 alone writes one: copy "
                             "rank 0's to this machine's out_dir, or give the processes one shared out_dir"),
                       ("0", "start the run without --resume")):
        for key, value in {**env, "RANK": rank, "LOCAL_RANK": rank}.items():
            monkeypatch.setenv(key, value)
        with pytest.raises(UsageError) as refused:
            resume_target(None, [f"out_dir={tmp_path / 'out'}"])
        assert str(refused.value) == f"nothing to resume: no '{shown(str(tmp_path / 'out' / 'ckpt.pt'))}'; {says}"
