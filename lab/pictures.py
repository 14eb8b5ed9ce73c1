"""Writing pictures: the format a name asks for, where it may be written without losing anything, a check made
before the work of drawing, the write itself (no half picture), and the PNG a TensorBoard event holds.

Used by every picture tinychar writes: the attention heatmaps (lab/heatmap.py: train.py's TensorBoard grid,
sample.py --attention-map) and `python -m lab sort --heatmap`.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if not __package__:  # run as a file (python lab/pictures.py): the project's packages are one folder up
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # functions, not a command: said at once, before the seconds of importing torch
    from lab import not_a_command

    raise SystemExit(not_a_command("lab/pictures.py"))

from PIL import Image

from configs.userinput import resolved, shown

if TYPE_CHECKING:
    from training.events import EventWriter

# Formats that hold icons of fixed sizes: a picture saved in them is not the picture drawn (measured, Pillow 13: a
# 900 x 700 picture came back 256 x 199 from .ico and 1024 x 1024 from .icns).
ICONS = {"ICO": "shrunk to at most 256 x 256 pixels", "ICNS": "stretched to a square"}
# Names of formats that hold less than colour, which Pillow fills with the colour picture all the same, whatever the
# name says (Pillow 13: a P6 pixmap in .pbm, .pgm and .pfm, an RGB SGI file in .bw). A heatmap's meaning is in its
# colours (a grey cell is one the mask hides), so it is not made grey to fit them: the name is refused.
LESS_THAN_COLOUR = {
    ".pbm": ("a black-and-white bitmap", "a colour pixmap"),
    ".pgm": ("a greyscale map", "a colour pixmap"),
    ".pfm": ("a map of floating-point numbers", "a colour pixmap of bytes"),
    ".bw": ("a greyscale SGI picture", "a colour one"),
}
# Formats Pillow is dropping. IM: deprecated (Pillow 13 warns on every save and open), removed in Pillow 15, after which
# a picture written now could not be told from a person's file there (is_picture) nor written again; and its header
# holds the name of the file it is written to, in ASCII: a name in other letters failed after the work (lab sort: after
# the training), where image_format's test save, into a file without a name, had passed. Refused, not fixed for now.
DROPPED = {"IM": "deprecated, and gone in Pillow 15"}
# What Pillow decides from the name of the file it writes (a .j2k name gets the raw codestream, any other a JP2
# container; .j2c and .jpc name codestreams too), given as options: write_picture hands it a file without a name.
SAVE_OPTIONS = dict.fromkeys((".j2k", ".j2c", ".jpc"), {"no_jp2": True})


def image_format(path: str | Path) -> str:
    """The Pillow format that a picture named path is written in: the one its extension names (map.jpg: JPEG), PNG
    for a name without one; ValueError, in words, for an extension Pillow cannot write, or writes only as an icon
    (ICONS), or writes as another kind of picture than the name says (LESS_THAN_COLOUR), or is dropping (DROPPED)."""
    suffix = Path(path).suffix.lower()
    if not suffix:
        return "PNG"
    if suffix in LESS_THAN_COLOUR:
        promised, written = LESS_THAN_COLOUR[suffix]
        raise ValueError(f"a '{suffix}' file is {promised}, but Pillow writes {written} there whatever the name says; "
                         f"name it .png (or .ppm, .jpg, .webp, .gif, ...)")
    Image.init()  # registers every plugin's extensions, not only the common ones loaded at import
    name = Image.registered_extensions().get(suffix)
    if name is None or name not in Image.SAVE:
        raise ValueError(f"Pillow cannot write '{suffix}' pictures; name it .png (or .jpg, .webp, .gif, ...)")
    if name not in Image.OPEN:  # PDF, PALM: a file of it could not be told from a person's file the next time
        raise ValueError(f"Pillow writes '{suffix}' files but cannot read them back, so a later run could not tell "
                         f"its own picture from another file there; name it .png (or .jpg, .webp, .gif, ...)")
    if name in DROPPED:
        raise ValueError(f"'{suffix}' is a format Pillow is dropping ({DROPPED[name]}), so a later run could neither "
                         f"write it nor tell its own picture from another file there; name it .png (or .jpg, .webp, "
                         f".gif, ...)")
    if name in ICONS:
        raise ValueError(f"'{suffix}' is an icon format, which Pillow writes {ICONS[name]}, not as drawn; name it .png "
                         f"(or .jpg, .webp, .gif, ...)")
    try:  # some formats it writes only in other modes (.xbm: black and white), or only with a plugin (.h5)
        Image.new("RGB", (1, 1)).save(io.BytesIO(), format=name, **SAVE_OPTIONS.get(suffix, {}))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"Pillow cannot write '{suffix}' pictures in colour ({e}); name it .png (or .jpg, .webp, "
                         f".gif, ...)") from None
    return name


def picture_target(path: str | Path) -> tuple[Path, str]:
    """Where a picture named path is written, and in which format (image_format): the file a symbolic link leads to,
    so that the link stays a link. ValueError, in words, where writing would lose something: a folder there, or
    anything but a picture or an empty file (a checkpoint, a run's .lock, a device such as /dev/null, a pipe),
    which the rename that writes it would replace; the file this command's stdout or stderr goes to (output_stream);
    or a loop of symbolic links on the way."""
    kind = image_format(path)
    try:
        target = resolved(path)
    except OSError:  # a loop of links (resolved raises nothing else)
        raise ValueError("a loop of symbolic links is on the way there; give another path") from None
    try:
        folder, there = target.is_dir(), target.exists()
    except OSError as e:  # a name too long for the system, say: Path.is_dir raises it rather than answer False
        raise ValueError(f"{e.strerror or type(e).__name__}; give another path") from None
    if folder:
        raise ValueError(f"it is a folder; give a file name such as {shown(str(target / 'attention.png'))}")
    if there and not target.is_file():
        raise ValueError("it is not a plain file (a device, a pipe or a socket), which the picture would replace; "
                         "give a file name")
    if (stream := output_stream(path, target)) is not None:  # a deleted file's /proc/self/fd/1 is not there
        raise ValueError(f"it is where this command's output ({stream}) is written, which the picture would "
                         f"replace; name a picture file")
    if there and target.stat().st_size and not is_picture(target):
        raise ValueError("a file that is not a picture is there, which the picture would replace; give another name "
                         "(or remove that file first)")
    return target, kind


def output_stream(path: str | Path, target: Path) -> str | None:
    """'stdout' or 'stderr' where the file at path is the one this process writes that stream to, else None. The
    shell makes the file of `> out.txt` empty before the command starts, and /dev/stdout leads to it: taken for an
    empty file that a picture may replace, it became the picture, and what was printed went to the old, unlinked
    file. Both the path and the file its links lead to are looked at: /proc/self/fd/1 of a deleted file resolves to
    a name that is not there."""
    files = set()
    for name in (path, target):
        try:
            found = os.stat(name)
        except (OSError, ValueError):  # not there; ValueError: a NUL in the name
            continue
        files.add((found.st_dev, found.st_ino))
    for fd, stream in ((1, "stdout"), (2, "stderr")):
        try:
            opened = os.fstat(fd)
        except OSError:  # closed
            continue
        if (opened.st_dev, opened.st_ino) in files:
            return stream
    return None


def check_picture_path(path: str | Path) -> Path:
    """Where write_picture would write path (picture_target), or ValueError, in words, where it could not: besides
    picture_target's refusals, a file there that cannot be written, a file where a folder must be, or a folder that
    cannot be written. So that a picture is refused before the work of drawing it rather than after."""
    target, _ = picture_target(path)
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError("the file there cannot be written; give another path")
    above = target.parent
    while not above.exists() and above != above.parent:  # write_picture creates the missing folders
        above = above.parent
    if not above.is_dir():
        raise ValueError(f"'{shown(str(above))}' is a file, not a folder; give another path")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ValueError(f"the folder '{shown(str(above))}' cannot be written; give another path")
    # os.access answers from the permission bits, and for root it allows everything: /proc, a read-only mount or a
    # full table of inodes refuse only a real file, so one is made there and removed
    try:
        fd, probe = tempfile.mkstemp(prefix=".picture-probe.", dir=above)
    except OSError as e:
        raise ValueError(f"the folder '{shown(str(above))}' cannot be written ({e.strerror or e}); give another "
                         f"path") from None
    os.close(fd)
    os.unlink(probe)
    return target


def is_picture(path: Path) -> bool:
    """Whether Pillow recognises the file at path as a picture (from its first bytes)."""
    try:
        with warnings.catch_warnings():  # tinychar's own largest pictures are past Pillow's warning size
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path):
                return True
    except Image.DecompressionBombError:  # a picture all the same, only a large one
        return True
    except (OSError, ValueError, SyntaxError):  # UnidentifiedImageError is an OSError; some plugins raise the others
        return False


def write_picture(image: Image.Image, path: str | Path) -> Path:
    """Write image where picture_target says (ValueError if nowhere), through a temporary file beside it renamed over
    it once complete, so that an interrupted or failed write leaves no half picture. Returns the path written."""
    target, kind = picture_target(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Its name cut to leave room for the dot and '.<pid>.part' in the 255 bytes most systems allow a name: a picture
    # named in 250 bytes, which check_heatmap lets through, failed here, after the work of drawing it.
    part = target.with_name(f".{os.fsdecode(os.fsencode(target.name)[:200])}.{os.getpid()}.part")
    try:
        # A file without a name (its descriptor's number): given the temporary name, Pillow wrote that name into the
        # picture's header (SGI) and took the format's variant from it (a .j2k got a JP2 container, not the raw
        # codestream). So the picture is what image_format's test save made, the name's choices passed as options.
        with open(os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666), "w+b") as file:
            image.save(file, format=kind, **SAVE_OPTIONS.get(Path(path).suffix.lower(), {}))
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    return target


def log_image(writer: EventWriter, tag: str, image: Image.Image, step: int) -> None:
    """Add image to a TensorBoard event file as tag at step, encoded as an RGB PNG here (what TensorBoard stores;
    torch's ``SummaryWriter.add_image`` took 0.25-0.4 s more for a 2,071 x 2,050 picture, turning the pixels into
    floats and back before encoding them, 2-core EPYC)."""
    rgb = image.convert("RGB")
    buffer = io.BytesIO()
    rgb.save(buffer, format="PNG")
    writer.add_png(tag, buffer.getvalue(), rgb.width, rgb.height, step)

