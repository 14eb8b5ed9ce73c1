"""TensorBoard's event files, written here: the records and the few messages a run logs, without importing
TensorBoard (0.28 s of every run's start, 2-core Zen 4 EPYC, and about 20 MB: torch.utils.tensorboard loads
protobuf, TensorBoard's stand-in for TensorFlow and its plugins' modules before writing a byte).

A file is a sequence of records, each a little-endian 64-bit length, the masked CRC-32C of those 8 bytes, the
data, and the masked CRC-32C of the data. Each record's data is one ``tensorboard.Event`` protocol buffer. The
messages, their field numbers and the plugins' conventions (a text is a string tensor under the "text" plugin, the
hyperparameters are three summaries of the "hparams" plugin) are TensorBoard's, from its .proto files
(tensorboard/compat/proto/event.proto, summary.proto, tensor.proto; plugins/hparams/api.proto, plugin_data.proto;
google/protobuf/struct.proto); tests read these files back with TensorBoard's own reader and compare the messages
with those torch.utils.tensorboard builds.

Every event goes to the file when it is added, one write(2) a record, so TensorBoard shows it at once and a failed
write (a full disk) raises OSError at the call that logged it, not later in a thread of its own.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

# CRC-32C (Castagnoli): the reflected polynomial, and the table of each byte's remainder
_POLY = 0x82F63B78
_TABLE = []
for _byte in range(256):
    _crc = _byte
    for _ in range(8):
        _crc = (_crc >> 1) ^ _POLY if _crc & 1 else _crc >> 1
    _TABLE.append(_crc)


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    table = _TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The record format's checksum: the CRC rotated right by 15 bits plus a constant (so that a CRC of data that
    holds CRCs is not itself trivially zero)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


# ----------------------------------------------------------------------------------- protocol buffer encoding
# Wire types: 0 varint, 1 64-bit, 2 length-delimited, 5 32-bit. Fields left at proto3's defaults are not written.


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # a negative int64 is its two's complement, ten bytes
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _int(field: int, n: int) -> bytes:
    return _varint(field << 3) + _varint(n) if n else b""


def _double(field: int, x: float) -> bytes:
    return _varint(field << 3 | 1) + struct.pack("<d", x)


def _float(field: int, x: float) -> bytes:
    try:
        packed = struct.pack("<f", x)
    except OverflowError:  # past float32's range: infinite, as protobuf stores it (a diverging run's gradient norm)
        packed = struct.pack("<f", math.copysign(math.inf, x))
    return _varint(field << 3 | 5) + packed


def _message(field: int, data: bytes) -> bytes:
    """A length-delimited field: an embedded message, bytes, or a string's UTF-8."""
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _text(field: int, text: str) -> bytes:
    return _message(field, text.encode("utf-8")) if text else b""


def _plugin(name: str, content: bytes = b"") -> bytes:
    """SummaryMetadata naming the plugin that shows a value, with that plugin's own message."""
    return _message(1, _text(1, name) + (_message(2, content) if content else b""))


# The hyperparameters' plugin (tensorboard/plugins/hparams): its tags, and the values of its enums used here
HPARAMS_EXPERIMENT, HPARAMS_START, HPARAMS_END = ("_hparams_/experiment", "_hparams_/session_start_info",
                                                  "_hparams_/session_end_info")
_DATA_TYPE_STRING, _DATA_TYPE_FLOAT64, _STATUS_SUCCESS = 1, 3, 1
_DT_STRING = 7  # TensorProto's dtype for strings
_SESSION_START = 1  # SessionLog.START

WRITER = "tinychar training/events.py"  # the first event's source_metadata.writer: who wrote the file
_files = itertools.count()  # the last part of a file's name, as TensorBoard numbers the files of one process


PREFIX = "events.out.tfevents."


def file_name(log_dir: str | Path, now: float) -> str:
    """A new event file's name, TensorBoard's events.out.tfevents.<seconds>.<host>.<pid>.<n>, that sorts after every
    event file already in log_dir: TensorBoard reads a folder's files in the order of their names, so a resumed run's
    file must come after the run's before it. Where one of those was made in this second (a run stopped and resumed
    at once), <seconds> is the next second after it, as the pid or the count alone may sort backwards (10 before 9:
    a resume read first, its purge before the events it purges, the old curve shown after the new)."""
    seconds = int(now)
    for name in os.listdir(log_dir):
        field = name[len(PREFIX) :].split(".", 1)[0] if name.startswith(PREFIX) else ""
        if field.isdigit():
            seconds = max(seconds, int(field) + 1)
    return f"{PREFIX}{seconds:010d}.{socket.gethostname()}.{os.getpid()}.{next(_files)}"


class EventWriter:
    """Writes a run's TensorBoard events into a new file in log_dir (made if missing), named as TensorBoard names
    its own and sorting after the files there (file_name).

    purge_step: TensorBoard hides every event of this folder's earlier files at or after that step (a restarted
    run's "start" session log, written as torch.utils.tensorboard.SummaryWriter writes it). The methods may be
    called from several threads. Once closed, it writes nothing more: an event added then is dropped."""

    def __init__(self, log_dir: str | Path, purge_step: int | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        os.makedirs(log_dir, exist_ok=True)
        self.path = Path(log_dir) / file_name(log_dir, clock())
        self._lock = threading.Lock()
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        self._event(_text(3, "brain.Event:2") + _message(10, _text(1, WRITER)))  # Event.source_metadata
        if purge_step is not None:
            self._event(_text(3, "brain.Event:2"), purge_step)
            self._event(_message(7, _int(1, _SESSION_START)), purge_step)

    def _event(self, what: bytes, step: int | None = None) -> None:
        """One Event: its wall time, its step, and what it holds (the encoded field of Event's oneof)."""
        data = _double(1, self.clock()) + (_int(2, int(step)) if step is not None else b"") + what
        with self._lock:
            if self._fd is None:  # closed: nothing more is written (a picture drawn while a write failed)
                return
            try:
                self._write(record(data))
            except OSError as e:  # said with the file's name, so that it is not taken for stdout's failure
                raise OSError(e.errno, e.strerror, str(self.path)) from None

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def _summary(self, values: list[bytes], step: int | None) -> None:
        """A Summary of Summary.Values (each encoded), as one event at step."""
        self._event(_message(5, b"".join(_message(1, v) for v in values)), step)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """A point of the scalar series tag (stored as float32, TensorBoard's simple_value)."""
        self._summary([_text(1, tag) + _float(2, float(value))], step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        """Markdown text, shown by TensorBoard's text dashboard as tag (under tag + '/text_summary', the name
        torch.utils.tensorboard gives it, so that runs logged before and after this writer share a tag)."""
        tensor = _int(1, _DT_STRING) + _message(2, _message(2, _int(1, 1))) + _message(8, text.encode("utf-8"))
        self._summary([_text(1, tag + "/text_summary") + _message(9, _plugin("text")) + _message(8, tensor)], step)

    def add_png(self, tag: str, png: bytes, width: int, height: int, step: int) -> None:
        """A picture, already encoded as an RGB PNG of width x height pixels."""
        image = _int(1, height) + _int(2, width) + _int(3, 3) + _message(4, png)
        self._summary([_text(1, tag) + _message(4, image)], step)

    def add_hparams(self, hparams: Mapping[str, str | bool | int | float], metrics: list[str]) -> None:
        """The run's hyperparameters, for TensorBoard's HParams dashboard, with the tags of the scalars that measure
        it. A bool is the number 1 or 0, as torch.utils.tensorboard's hparams() makes it (a bool is an int to
        Python), so that runs logged before and after this writer agree."""
        infos, values = [], []
        for key, value in hparams.items():
            if isinstance(value, str):
                kind, encoded = _DATA_TYPE_STRING, _message(3, value.encode("utf-8"))  # even '': a oneof
            elif isinstance(value, (bool, int, float)):
                kind, encoded = _DATA_TYPE_FLOAT64, _double(2, float(value))
            else:
                raise TypeError(f"hyperparameter {key} is a {type(value).__name__}, not a str, bool, int or float")
            infos.append(_message(4, _text(1, key) + _int(4, kind)))
            values.append(_message(1, _text(1, key) + _message(2, encoded)))  # a map<string, Value> entry
        metric_infos = [_message(5, _message(1, _text(2, tag))) for tag in metrics]
        for tag, content in ((HPARAMS_EXPERIMENT, _message(2, b"".join(infos + metric_infos))),
                             (HPARAMS_START, _message(3, b"".join(values))),
                             (HPARAMS_END, _message(4, _int(1, _STATUS_SUCCESS)))):
            self._summary([_text(1, tag) + _message(9, _plugin("hparams", content))], None)

    def flush(self) -> None:
        """Nothing waits here: each event was written when it was added (the method of torch's SummaryWriter, for
        code written against it)."""

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
