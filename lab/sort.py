"""Sorting digits with attention: the notes' encoder-decoder exercise, trained and measured in seconds on a CPU.

``python -m lab sort`` trains a GRU encoder-decoder with Bahdanau attention (``--score additive|dot``), or the
same task with the bottleneck (``--no-attention``: the decoder sees only the final encoder state), or a tiny
transformer encoder-decoder (``--model transformer``). It prints the exact-sequence accuracy of greedy decoding
on held-out sequences and saves the decoder-over-encoder attention as a heatmap. ``--bottleneck`` prints accuracy
by length with and without attention instead. ``--min-length`` mixes lengths in a batch, padded, and says how many
answers the padding changes: none under the padding mask, some without it (``--no-padding-mask``).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from typing import NamedTuple

if not __package__:  # run as a file (python lab/sort.py): the project's packages are one folder up
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # python lab/sort.py, python -m lab.sort: started as python -m lab sort is, before
    # torch loads (a Ctrl-C while it loaded was a traceback; stdout was not made to take any text)
    from training.interpreter import refuse_old_python  # reads only sys and os, on any Python that parses this

    refuse_old_python(__file__)  # before the imports, which fail on a Python older than tinychar needs
    from lab.__main__ import main as lab_main

    raise SystemExit(lab_main(["sort", *sys.argv[1:]]))

import torch

from configs.userinput import OneLineParser, real, shell_word, shown
from lab import output_failed
from lab.pictures import write_picture
from lab.seq2seq import SCORES, GRUSeq2Seq, Seq2SeqConfig, TransformerSeq2Seq, build
from lab.sort_options import check_apart, check_lengths, contradiction
from lab.sort_outputs import check_heatmap, default_heatmap, describe, heatmap_of, log_result, tensorboard_writer
from lab.sort_task import Batch, PaddingCheck, decode, padding_check, sorting_batch, sorting_loss
from model.config import short_int
from training.memory import allocatable_bytes, whose_memory
from training.optim import AdamW
from training.signals import Interrupted, InterruptSignals

MODELS = ("gru", "transformer")
FLOAT32_MAX = torch.finfo(torch.float32).max
# The most --steps: the default 400 train in about 10 s on a 2-core CPU, so this is an hour or more, past any exercise
# of the notes. 10**12 steps ran for weeks, the list of losses growing by some 32 bytes a step, with no word.
MAX_STEPS = 100_000


@dataclass(frozen=True, kw_only=True)
class SortConfig:
    """One sorting run: the task, the model and its training."""

    model: str = "gru"
    """'gru' (encoder, attention layer, decoder) or 'transformer' (encoder-decoder with cross-attention)."""
    length: int = 8
    """Digits per sequence, input and output alike."""
    digits: int = 10
    """Alphabet size: sequences are drawn uniformly from 0..digits-1, with repeats."""
    score: str = "additive"
    """GRU attention score: 'additive' (Bahdanau) or 'dot' (scaled dot product)."""
    attention: bool = True
    """GRU only: False is the bottleneck, the decoder's context is the final encoder state alone."""
    n_embd: int = 64
    """Width of the model."""
    steps: int = 400
    """Optimiser steps, each on a fresh batch."""
    batch_size: int = 128
    """Sequences per step."""
    learning_rate: float = 3e-3
    """Adam's peak learning rate; it decays to a tenth along a cosine."""
    eval_size: int = 2000
    """Held-out sequences the accuracy is measured on."""
    seed: int = 0
    """Seeds the weights, the training batches and (seed + 1, held_out_seed) the held-out sequences."""
    min_length: int | None = None
    """Shortest sequence: each holds from min_length to length digits, padded at the end. None: all of length."""
    padding_mask: bool = True
    """With min_length: attention never looks at the padding. False leaves it in view, to compare."""

    def held_out_seed(self) -> int:
        """seed + 1, wrapped around within the signed 64-bit seeds (the largest one's successor is the smallest)."""
        return (self.seed + 1 + 2**63) % 2**64 - 2**63

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(SCORES)}, got {self.score!r}")
        if self.model == "transformer" and not self.attention:
            raise ValueError("--no-attention is for the GRU; a transformer without attention has nothing left")
        for name in ("length", "steps", "batch_size", "eval_size", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {short_int(getattr(self, name))}")
        if self.steps > MAX_STEPS:
            raise ValueError(f"steps must be at most {MAX_STEPS:,} (the default 400 take seconds), got "
                             f"{short_int(self.steps)}")
        if self.digits < 2:
            raise ValueError(f"digits must be at least 2, got {self.digits}")
        for name in ("length", "digits", "batch_size", "eval_size", "n_embd"):
            # past 64 bits no run fits anywhere, and its memory estimate is past float's range (an OverflowError)
            if getattr(self, name) > 2**63 - 1:
                raise ValueError(f"{name} must be at most 2**63 - 1, got {short_int(getattr(self, name))}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"learning_rate must be a finite number > 0, got {self.learning_rate}")
        if self.learning_rate > FLOAT32_MAX:  # Adam keeps it as a float32 number
            raise ValueError(f"learning_rate must be at most float32's largest number, {FLOAT32_MAX:.4g}, got "
                             f"{self.learning_rate:g}")
        if not -(2**63) <= self.seed < 2**63:  # what torch.manual_seed takes without an overflow
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {short_int(self.seed)}")
        if self.min_length is not None and not 1 <= self.min_length <= self.length:
            raise ValueError(f"min_length must be from 1 to the length, {short_int(self.length)}, got "
                             f"{short_int(self.min_length)}")
        if not self.padding_mask and not self.padded:
            raise ValueError("--no-padding-mask needs padding to show: give --min-length below --length")
        if not self.padding_mask and not self.attention:
            raise ValueError("--no-padding-mask takes the mask off the attention, which --no-attention leaves out; "
                             "give one of them")

    @property
    def padded(self) -> bool:
        """Whether sequences of mixed lengths share a batch, the shorter ones padded."""
        return self.min_length is not None and self.min_length < self.length

    def seq2seq(self) -> Seq2SeqConfig:
        return Seq2SeqConfig(digits=self.digits, length=self.length, n_embd=self.n_embd, score=self.score,
                             attention=self.attention, padded=self.padded, padding_mask=self.padding_mask)

    def batch(self, n: int, generator: torch.Generator) -> Batch:
        """n sequences of this run's lengths, drawn from generator, and their sorted copies."""
        return sorting_batch(n, self.length, self.digits, generator, self.min_length)


def lr_at(step: int, cfg: SortConfig) -> float:
    """Cosine from the peak at step 0 to a tenth of it at the last step: the last steps polish, not jump."""
    progress = step / max(cfg.steps - 1, 1)
    return cfg.learning_rate * (0.1 + 0.9 * 0.5 * (1.0 + torch.cos(torch.tensor(progress * torch.pi)).item()))


def new_model(cfg: SortConfig) -> GRUSeq2Seq | TransformerSeq2Seq:
    """The untrained model, its weights drawn from cfg.seed without touching the global random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return build(cfg.seq2seq(), cfg.model)


class Diverged(Exception):
    """Training made the loss or the weights non-finite (a learning rate too high): what it measured would be noise,
    and a heatmap of weights that are not numbers."""


def train(model: GRUSeq2Seq | TransformerSeq2Seq, cfg: SortConfig, writer: object | None = None) -> list[float]:
    """Teacher-forced cross-entropy on fresh batches; returns the loss of every step. Diverged at the first step whose
    loss is not finite, or when the last step's update leaves a weight that is not."""
    generator = torch.Generator().manual_seed(cfg.seed)
    # Adam's steps to the bit; torch.optim.Adam's first imports torch's compiler (1.35 s of `python -m lab sort`)
    optimiser = AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(cfg.steps):
        for group in optimiser.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = cfg.batch(cfg.batch_size, generator)
        logits, _ = model(batch.src, batch.tgt_in)  # (B, T, digits)
        loss = sorting_loss(logits, batch.tgt, cfg.digits)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):  # no step after it learns: the weights are past recovery
            raise Diverged(f"the loss became {losses[-1]} at step {step + 1} of {cfg.steps} ({describe(cfg)}, length "
                           f"{cfg.length})")
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        # A GRU unrolled through its decoder loop can take one huge step that undoes the rest; clipping keeps it.
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        if writer is not None and step % 10 == 0:
            writer.add_scalar("loss/train", losses[-1], step)
    if not all(p.isfinite().all() for p in model.parameters()):  # the last step's update, after its loss was taken
        raise Diverged(f"the weights became non-finite at the last step, {cfg.steps} ({describe(cfg)}, length "
                       f"{cfg.length})")
    return losses


def memory_need(cfg: SortConfig) -> int:
    """Bytes a run of cfg allocates at its peak, roughly and from above: what grows with the batch, the length and
    the alphabet. Fitted to the peak memory measured for long sequences, wide alphabets and big batches (from 1.2
    times it, for big batches, to 1.8 times, for a transformer on long sequences); torch itself, a few hundred MB, is
    not counted."""
    B, T, D, E, C = cfg.batch_size, cfg.length, cfg.digits, cfg.eval_size, cfg.n_embd
    floats = 4 * (3 * D * C + 30 * C * C)  # weights, gradients and Adam's two moments
    # logits and their gradients; greedy decoding's, a step's alive while the next are made (--digits 200000, 3.9 GB
    # peak where one was counted: 2.3 GB); states and embeddings
    floats += 2 * B * T * D + 2 * E * D + 20 * (B + E) * T * C
    if cfg.model == "transformer":
        heads = cfg.seq2seq().n_head
        # the encoder's and decoder's activations kept for the backward pass, about 45 x n_embd floats a position (peak
        # 2.2, 4.1 and 7.7 GB at --batch-size 20,000, 40,000 and 80,000, length 8; the 20 above made 1.1, 2.0 and 3.9)
        floats += 28 * B * T * C
        floats += 12 * B * heads * T * T + 10 * E * heads * T * T  # attention weights: training, then greedy decoding
        # greedy decoding takes the logits of the whole prefix at each step: (E, T, D) at the last, two alive at
        # once (--digits 8000 --length 32 peaked at 5.2 GB, counted here at 0.6 GB before)
        floats += 2 * E * T * D
    elif cfg.attention:  # each decoder step keeps its scores over all T encoder states for the backward pass
        floats += (8 if cfg.score == "additive" else 5) * B * T * T * C + E * T * T
    return 4 * floats


def check_memory(cfg: SortConfig, option: str = "--length") -> None:
    """ValueError, in one line, when a run of cfg (its length given by option) would not fit in the free memory."""
    cpu = torch.device("cpu")
    need, free = memory_need(cfg), allocatable_bytes(cpu)
    if free is not None and need > free:
        raise ValueError(f"a run of {option} {cfg.length}, --digits {cfg.digits} and --batch-size {cfg.batch_size} "
                         f"({describe(cfg)}) needs about {need / 1e9:,.1f} GB of memory and {whose_memory(cpu, free)} "
                         f"{free / 1e9:,.1f} GB free; make them smaller")


def held_out(cfg: SortConfig) -> Batch:
    """The evaluation sequences: their own generator, so they are the same whatever the training did."""
    return cfg.batch(cfg.eval_size, torch.Generator().manual_seed(cfg.held_out_seed()))


class SortResult(NamedTuple):
    model: GRUSeq2Seq | TransformerSeq2Seq
    accuracy: float
    seconds: float  # training time
    example: torch.Tensor  # (T,) the first held-out sequence (with padding, the first padded one)
    weights: torch.Tensor | None  # (T_out, T_in) attention while decoding it; None without attention
    answer: torch.Tensor  # (T,) the model's greedy answer to it, the one the attention was taken writing
    padding: PaddingCheck | None = None  # the held-out sequences decoded alone, without padding; None: no padding


def run(cfg: SortConfig, writer: object | None = None) -> SortResult:
    """Train a model as cfg says and measure it on the held-out sequences."""
    model = new_model(cfg)
    start = time.perf_counter()
    train(model, cfg, writer)
    seconds = time.perf_counter() - start
    batch = held_out(cfg)
    accuracy, answers, weights = decode(model, batch)
    padding = padding_check(model, batch) if cfg.padded else None
    shown_row = int((batch.src == cfg.digits).any(dim=-1).long().argmax())  # the first padded row, else row 0
    return SortResult(model, accuracy, seconds, batch.src[shown_row], None if weights is None else weights[shown_row],
                      answers[shown_row], padding)


def bottleneck_table(base: SortConfig, lengths: list[int]) -> list[tuple[int, float, float]]:
    """(length, accuracy with attention, accuracy without) for each length, same budget for both."""
    rows = []
    for length in lengths:
        cfg = replace(base, model="gru", length=length)
        rows.append((length, run(replace(cfg, attention=True)).accuracy, run(replace(cfg, attention=False)).accuracy))
    return rows


def parser() -> OneLineParser:
    p = OneLineParser(prog="python -m lab sort", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gru", help="gru (default) or transformer")
    p.add_argument("--score", default=None, help="GRU attention score: additive (default) or dot")
    p.add_argument("--no-attention", action="store_true", help="GRU without attention: the bottleneck")
    p.add_argument("--length", type=int, default=None, help="digits per sequence (default 8)")
    p.add_argument("--min-length", type=int, default=None,
                   help="mix lengths: each sequence holds from this many digits to --length, the shorter ones padded "
                        "at the end, and the padding mask keeps attention off the padding (default: all --length)")
    p.add_argument("--no-padding-mask", action="store_true",
                   help="with --min-length: leave the padding in attention's view, to see what the mask is for")
    p.add_argument("--digits", type=int, default=10, help="alphabet size (default 10: digits 0-9)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps (default 400 GRU, 600 transformer; at most {MAX_STEPS:,}, in all the runs of "
                        f"--bottleneck)")
    p.add_argument("--batch-size", type=int, default=128, help="sequences per training step (default 128)")
    p.add_argument("--lr", type=real, default=None, help="peak learning rate (default 3e-3 GRU, 1e-3 transformer)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for the weights and the random sequences; the same seed gives the same run (default 0)")
    p.add_argument("--heatmap", default=None,
                   help="the picture to write, in the format its extension names, PNG without one (default "
                        "sort_<model>_<attention>.png, and the lengths, padding mask and digits where they are not the "
                        "default: sort_gru_additive_attention_len2-8_nomask.png); missing folders on its path are made")
    p.add_argument("--logdir", default=None, help="also log loss, accuracy and the heatmap to TensorBoard here")
    p.add_argument("--bottleneck", action="store_true",
                   help="print accuracy by length with and without attention (GRU) instead of one run")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="lengths for --bottleneck (default 8 16)")
    return p


# The options that set SortConfig's fields: its checks name the fields, the command line's refusals the options.
OPTION_OF = {"model": "--model", "score": "--score", "length": "--length", "digits": "--digits", "steps": "--steps",
             "batch_size": "--batch-size", "learning_rate": "--lr", "seed": "--seed", "min_length": "--min-length"}


def config_from(args: object) -> SortConfig:
    """The SortConfig the options ask for; a ValueError naming the option (--lr, not learning_rate) if one is bad."""
    transformer = args.model == "transformer"
    try:
        return SortConfig(
            model=args.model, length=args.length if args.length is not None else 8, digits=args.digits,
            score=args.score if args.score is not None else "additive",
            attention=not args.no_attention, batch_size=args.batch_size, seed=args.seed,
            steps=args.steps if args.steps is not None else (600 if transformer else 400),
            learning_rate=args.lr if args.lr is not None else (1e-3 if transformer else 3e-3),
            min_length=args.min_length, padding_mask=not args.no_padding_mask,
        )
    except ValueError as e:
        field, must, rest = str(e).partition(" must ")
        if must and field in OPTION_OF:
            raise ValueError(f"{OPTION_OF[field]} must {rest}") from None
        raise


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        # SIGTERM as well as Ctrl-C, and from the checks on (torch takes seconds to load): SIGTERM ended the
        # run without a word, and Ctrl-C during the checks was a traceback
        with InterruptSignals():
            return checked_run(p, args)
    except (KeyboardInterrupt, Interrupted) as e:  # what is printed stays, and a heatmap is written whole or not
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"\ninterrupted ({signal.Signals(signum).name}); stopped sorting", file=sys.stderr)
        return 128 + signum


def checked_run(p: OneLineParser, args: object) -> int:
    """The run args ask for, once its options are checked (a bad one exits through p.error); its exit status."""
    try:
        if (wrong := contradiction(args)) is not None:
            raise ValueError(wrong)
        if sys.stdout is None:  # started with stdout closed (`>&-`): the accuracy would go nowhere
            raise ValueError("stdout is closed, and the results are written there; redirect it to a file (> out.txt) "
                             "or to /dev/null instead of closing it")
        if args.logdir == "":
            raise ValueError("--logdir is empty; give the folder for TensorBoard's logs (or leave it out)")
        # '~' is the home folder, as in sample.py's and train.py's paths (the shell leaves --heatmap=~/s.png alone)
        args.heatmap, args.logdir = (path and os.path.expanduser(path) for path in (args.heatmap, args.logdir))
        cfg = config_from(args)
        lengths = args.lengths if args.lengths is not None else [8, 16]
        if args.bottleneck:
            check_lengths(lengths, cfg.steps, MAX_STEPS)
        # before any allocation: the longest run, where the kernel would otherwise step in (or torch, in a traceback)
        check_memory(replace(cfg, model="gru", length=max(lengths)) if args.bottleneck else cfg,
                     "--lengths" if args.bottleneck else "--length")
        heatmap = args.heatmap if args.heatmap is not None else default_heatmap(cfg)
        if not args.bottleneck and not args.no_attention:  # the runs that draw a heatmap
            check_heatmap(heatmap)
            check_apart(heatmap, args.logdir)
        writer = None if args.bottleneck else tensorboard_writer(args.logdir)
    except ValueError as e:
        p.error(str(e))
    try:
        try:
            code = report(args, cfg, lengths, heatmap, writer)
        except Diverged as e:  # nothing printed of it, nor drawn: an accuracy of 0% and a heatmap of nan
            if writer is not None:
                writer.close()  # the losses logged until then, which show where it went
            print(f"error: training diverged: {e}; give a lower --lr than {cfg.learning_rate:g}", file=sys.stderr)
            code = 2
        sys.stdout.flush()  # here, where a full disk is one line, not at exit in a traceback
        return code
    except OSError as e:
        if writer is not None and e.filename == str(writer.path):  # the TensorBoard file, not stdout
            print(f"error: cannot write TensorBoard logs into '{shown(args.logdir)}' ({e.strerror or e}); give "
                  f"--logdir a folder with room, or leave it out", file=sys.stderr)
            return 1
        return output_failed(e)


def report(args: object, cfg: SortConfig, lengths: list[int], heatmap: str, writer: object | None) -> int:
    """Run what args ask (a table for --bottleneck, or one run, its heatmap and its logs) and print the results."""
    if args.bottleneck:
        print(f"exact-sequence accuracy on {cfg.eval_size} held-out sequences of digits 0-{cfg.digits - 1}, "
              f"GRU, {cfg.steps} steps of {cfg.batch_size}, {cfg.score} attention vs the final state alone")
        print("length  attention  no attention")
        for length, with_attn, without in bottleneck_table(cfg, lengths):
            print(f"{length:>6}  {with_attn:>9.1%}  {without:>12.1%}", flush=True)
        return 0
    result = run(cfg, writer)
    lengths = f"lengths {cfg.min_length}-{cfg.length}, padded" if cfg.padded else f"length {cfg.length}"
    print(f"{describe(cfg)}, {lengths}, digits 0-{cfg.digits - 1}: {cfg.steps} steps in "
          f"{result.seconds:.1f} s; exact-sequence accuracy {result.accuracy:.2%} on {cfg.eval_size} "
          f"held-out sequences")
    if result.padding is not None:
        print(f"decoded alone, without their padding: exact-sequence accuracy {result.padding.accuracy_alone:.2%}, "
              f"{result.padding.changed} of {cfg.eval_size} answers changed")
    image = heatmap_of(result, cfg) if result.weights is not None else None
    if image is not None:
        try:
            path = write_picture(image, heatmap)
        except (OSError, ValueError) as e:  # what changed there since the check before training
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            print(f"error: cannot write the heatmap '{shown(heatmap)}' ({reason}); give another --heatmap path",
                  file=sys.stderr)
            return 2
        print(f"heatmap: {shell_word(str(path))}")  # one line, to paste back whatever the name holds
    if writer is not None:
        log_result(writer, result, image, cfg)
        print(f"TensorBoard: {shell_word(str(args.logdir))}")
    return 0
