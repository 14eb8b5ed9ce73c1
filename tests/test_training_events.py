"""training/events.py: the event files it writes are the ones torch.utils.tensorboard writes, read back by
TensorBoard's own reader."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from training.events import EventWriter, crc32c, masked_crc32c

HPARAMS = {"model.n_layer": 3, "train.learning_rate": 0.01, "train.compile": "auto", "model.bias": True,
           "data.path": "", "seed": 2**63 - 1, "model.dropout": 0.0}


def records(path: Path) -> list[bytes]:
    """The data of every record of an event file, each checked as TensorBoard's reader checks it."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as theirs

    raw, out, at = path.read_bytes(), [], 0
    while at < len(raw):
        header = raw[at : at + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", raw[at + 8 : at + 12])[0] == theirs(header)
        data = raw[at + 12 : at + 12 + length]
        assert struct.unpack("<I", raw[at + 12 + length : at + 16 + length])[0] == theirs(data)
        out.append(data)
        at += 16 + length
    return out


def events(folder: Path) -> list:
    """The folder's one event file as tensorboard.Event messages, their wall times zeroed and the hyperparameters'
    plugin content parsed (a map's entries may come in any order)."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    (path,) = folder.glob("events.out.tfevents.*")
    out = []
    for data in records(path):
        event = Event.FromString(data)
        assert event.wall_time > 1.7e9
        event.wall_time = 0
        hparams = []
        for value in event.summary.value:
            if value.metadata.plugin_data.plugin_name == "hparams":
                hparams.append(HParamsPluginData.FromString(value.metadata.plugin_data.content))
                value.metadata.plugin_data.content = b""
        out.append((event, hparams))
    return out


def test_the_checksum_is_crc32c_masked_as_tensorflow_masks_it():
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as theirs

    assert crc32c(b"123456789") == 0xE3069283  # CRC-32C's check value
    for data in (b"", b"a", os.urandom(1000), bytes(range(256)) * 3):
        assert masked_crc32c(data) == theirs(data)


@pytest.mark.parametrize("purge_step", [None, 0, 41])
def test_the_events_are_those_torchs_summary_writer_writes(tmp_path, purge_step):
    from tensorboard.compat.proto.summary_pb2 import Summary
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    png = b"\x89PNG\r\n\x1a\n not decoded by the writer"
    mine = EventWriter(tmp_path / "mine", purge_step=purge_step)
    theirs = SummaryWriter(str(tmp_path / "theirs"), purge_step=purge_step)
    for writer in (mine, theirs):
        writer.add_scalar("loss/val", 1.8734, 200)
        writer.add_scalar("lr", 0.0, 0)  # zero: a oneof's default is written all the same
        writer.add_scalar("tokens_per_sec", 123456.789, 2**40)
        writer.add_scalar("grad_norm", -1e39, 7)  # past float32's range: -inf (struct would refuse to pack it)
        writer.add_text("sample", "```\nROMEO: é 👋\n```", 200)
        writer.add_text("empty", "", 3)
    mine.add_png("attention/layers_x_heads", png, 640, 480, 200)
    theirs.file_writer.add_summary(Summary(value=[Summary.Value(
        tag="attention/layers_x_heads",
        image=Summary.Image(height=480, width=640, colorspace=3, encoded_image_string=png))]), 200)
    mine.add_hparams(HPARAMS, ["hparam/best_val_loss"])
    for summary in hparams(HPARAMS, {"hparam/best_val_loss": float("nan")}):
        theirs.file_writer.add_summary(summary)
    mine.close()
    theirs.close()
    mine_events, their_events = events(tmp_path / "mine"), events(tmp_path / "theirs")
    assert len(mine_events) == 1 + 2 * (purge_step is not None) + 6 + 1 + 3
    # the first event names the program that wrote the file
    assert mine_events[0][0].source_metadata.writer == "tinychar training/events.py"
    assert their_events[0][0].source_metadata.writer == "tensorboard.summary.writer.event_file_writer"
    for event, _ in mine_events[:1] + their_events[:1]:
        event.ClearField("source_metadata")
    assert mine_events == their_events


def test_tensorboard_reads_a_run_of_them_and_hides_what_a_restart_purged(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = EventWriter(tmp_path)
    for step in (10, 20, 30):
        first.add_scalar("loss/train", step / 10, step)
    first.close()
    again = EventWriter(tmp_path, purge_step=21)  # resumed from a checkpoint at step 20
    again.add_scalar("loss/train", 3.5, 30)
    again.add_text("sample", "to be", 30)
    again.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2  # one file each, named apart
    reader = EventAccumulator(str(tmp_path))
    reader.Reload()
    assert [(e.step, e.value) for e in reader.Scalars("loss/train")] == [(10, 1.0), (20, 2.0), (30, 3.5)]
    assert reader.Tensors("sample/text_summary")[0].tensor_proto.string_val == [b"to be"]


def test_an_event_added_after_closing_is_dropped_and_a_failed_write_raises(tmp_path, monkeypatch):
    import errno

    writer = EventWriter(tmp_path)
    (path,) = tmp_path.glob("events.out.tfevents.*")
    size = path.stat().st_size
    writer.close()
    writer.add_scalar("lr", 1.0, 1)  # a picture drawn in the background while the run stopped: nothing written
    writer.close()
    assert path.stat().st_size == size

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    writer = EventWriter(tmp_path / "full")
    monkeypatch.setattr(EventWriter, "_write", full)
    with pytest.raises(OSError, match="No space left"):  # at the call that logged it, not later in a thread
        writer.add_scalar("lr", 1.0, 1)
    writer.close()


def test_a_run_imports_no_tensorboard(tmp_path):
    # the point of the writer: torch.utils.tensorboard took 0.28 s of every run's start
    code = ("import sys, train\n"
            "code = train.main(sys.argv[1:], progress=False)\n"
            "assert code == 0, code\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorboard', 'google')))")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n" * 40, encoding="utf-8")
    from conftest import tiny_overrides

    args = ["--config", str(ROOT / "configs" / "tiny.yaml"),
            *tiny_overrides(corpus, tmp_path / "out", **{"train.max_iters": 4, "train.eval_interval": 2})]
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert list((tmp_path / "out").glob("events.out.tfevents.*"))


@pytest.mark.parametrize(("first", "then"), [(9, 10), (99, 100)])
def test_a_resume_in_the_same_second_is_read_after_the_run_it_continues(tmp_path, monkeypatch, first, then):
    # TensorBoard reads a folder's files in the order of their names: a resume's file named .10 after a run's .9, in
    # the same second, was read first, and the run's old curve (and its purge) came out of order (a CI run's failure)
    import itertools

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import training.events

    clock = lambda: 1796319133.25  # noqa: E731 - one second for both files
    monkeypatch.setattr(training.events, "_files", itertools.count(first))
    run = EventWriter(tmp_path, purge_step=0, clock=clock)
    for step in (10, 20, 30):
        run.add_scalar("loss/train", step / 10, step)
    run.close()
    monkeypatch.setattr(training.events, "_files", itertools.count(then))
    resumed = EventWriter(tmp_path, purge_step=21, clock=clock)
    resumed.add_scalar("loss/train", 3.5, 30)
    resumed.close()
    assert sorted(tmp_path.iterdir()) == [run.path, resumed.path]
    reader = EventAccumulator(str(tmp_path))
    reader.Reload()
    assert [(e.step, e.value) for e in reader.Scalars("loss/train")] == [(10, 1.0), (20, 2.0), (30, 3.5)]
    # another process's file of this second, whatever its pid, is followed too
    other = tmp_path / f"events.out.tfevents.{int(clock()) + 1}.{'z' * 20}.99999.0"
    other.write_bytes(b"")
    third = EventWriter(tmp_path, clock=clock)
    third.close()
    assert sorted(tmp_path.iterdir())[-1] == third.path
