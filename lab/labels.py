"""Characters as axis labels in tinychar's pictures (the attention heatmaps): whitespace made visible, characters the
font has no glyph for shown by their code point, and each label centred on its cell. Drawn with Pillow.
"""

from __future__ import annotations

import functools
import os
import sys
import unicodedata

if not __package__:  # run as a file (python lab/labels.py): the project's packages are one folder up
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # functions, not a command: said at once, before the seconds of importing torch
    from lab import not_a_command

    raise SystemExit(not_a_command("lab/labels.py"))

from PIL import ImageDraw, ImageFont

from configs.userinput import shows_nothing_alone

INK = (40, 40, 40)

# Symbols the default font has no glyph for; they are drawn as small line figures instead.
SPACE, NEWLINE, TAB = "␣", "↵", "→"


def display_char(ch: str) -> str:
    """How a character is written on an axis: whitespace made visible, control characters escaped ('\r', '\x00'),
    and the characters that show nothing alone as their code point: a combining mark (a Devanagari vowel sign, an
    Arabic fatha: the font drew a dotted circle and a box, which the check for a missing glyph does not catch) or an
    invisible one (U+200D, the joiner of emoji). The symbols themselves (a literal '→' in the text) are written as
    their code points, U+2192: drawn as they are, they were the same figure as the whitespace they stand for."""
    if ch in (SPACE, NEWLINE, TAB):
        return f"U+{ord(ch):04X}"
    if ch == " ":
        return SPACE
    if ch == "\n":
        return NEWLINE
    if ch == "\t":
        return TAB
    if unicodedata.category(ch) == "Cc":
        return ch.encode("unicode_escape").decode("ascii")
    if not ch.isprintable() or shows_nothing_alone(ch):
        return f"U+{ord(ch):04X}"
    return ch


# Fonts that draw accented Latin, Greek and Cyrillic, tried in order where the system has them (Pillow looks in the
# system's font folders): Linux distributions carry DejaVu Sans, macOS and Windows Arial. Pillow's built-in font
# (Aileron) has no glyph past ASCII, so with it a French corpus's "é" is labelled U+00E9. CJK stays code points.
WIDE_FONTS = ("DejaVuSans.ttf", "Arial.ttf", "arial.ttf")


@functools.cache
def _wide_font_path() -> str | None:
    """The first of WIDE_FONTS the system has, as a path, looked for once a process; None if none."""
    for name in WIDE_FONTS:
        try:
            return str(ImageFont.truetype(name, 12).path)
        except (OSError, ImportError):  # not installed, or Pillow without FreeType
            continue
    return None


def font_of(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """A font of size pixels: a wide one where the system has it (a new object each call: pictures are drawn on a
    thread of their own in training, and two threads should not share one FreeType face)."""
    if (path := _wide_font_path()) is not None:
        try:
            return ImageFont.truetype(path, size)
        except OSError:
            pass
    # Pillow >= 10.1 with FreeType scales its built-in font; without FreeType there is only the fixed bitmap one.
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):
        return ImageFont.load_default()


def text_size(font: ImageFont.ImageFont, text: str) -> tuple[int, int]:
    left, top, right, bottom = font.getbbox(text)
    return right - left, bottom - top


def legible(font: ImageFont.ImageFont, label: str) -> str:
    """The label, or its code point when the font would draw an empty box for it."""
    if label in (SPACE, NEWLINE, TAB) or len(label) != 1 or label.isascii():
        return label
    return f"U+{ord(label):04X}" if _no_glyph(font, label) else label


def legible_text(font: ImageFont.ImageFont, text: str) -> str:
    """A title as the font can draw it: each character it has no glyph for (a Chinese prompt, a run folder named in
    Cyrillic, with the built-in font) written as its code point, in place of a row of identical empty boxes."""
    out, base_missing = [], False
    for ch in text:
        mark = shows_nothing_alone(ch)
        # a mark on a letter written as its code point has nothing to sit on (a box, where HarfBuzz draws it)
        missing = not ch.isascii() and (_no_glyph(font, ch) or (mark and base_missing))
        out.append(f"<U+{ord(ch):04X}>" if missing else ch)
        base_missing = missing if not mark else base_missing
    return "".join(out)


def _no_glyph(font: ImageFont.ImageFont, ch: str) -> bool:
    missing = font.getmask("\uffff")  # a non-character: always the font's "no glyph" box
    mask = font.getmask(ch)
    return mask.size == missing.size and bytes(mask) == bytes(missing)


def fonts(px: int) -> tuple[ImageFont.ImageFont, ImageFont.ImageFont, ImageFont.ImageFont]:
    axis = font_of(max(10, min(14, px - 4)))
    return axis, font_of(13), font_of(16)


def symbol_half(font: ImageFont.ImageFont) -> int:
    return max(2, text_size(font, "x")[1] // 2)  # half the size of a drawn whitespace symbol


def label_width(font: ImageFont.ImageFont, label: str) -> int:
    if label in (SPACE, NEWLINE, TAB):
        return 2 * symbol_half(font) + 1
    return text_size(font, label)[0]


def draw_label(draw: ImageDraw.ImageDraw, label: str, cx: float, cy: float, font: ImageFont.ImageFont) -> None:
    """Draw one axis label centred on (cx, cy); the whitespace symbols are drawn as lines."""
    s = symbol_half(font)
    if label == SPACE:  # an open box on the baseline
        draw.line([(cx - s, cy), (cx - s, cy + s), (cx + s, cy + s), (cx + s, cy)], fill=INK, width=1)
    elif label == TAB:  # a right arrow
        draw.line([(cx - s, cy), (cx + s, cy)], fill=INK, width=1)
        draw.line(
            [(cx + s - s // 2 - 1, cy - s // 2 - 1), (cx + s, cy), (cx + s - s // 2 - 1, cy + s // 2 + 1)],
            fill=INK,
            width=1,
        )
    elif label == NEWLINE:  # down from the top right, then left, with an arrow head
        draw.line([(cx + s, cy - s), (cx + s, cy + s // 2), (cx - s, cy + s // 2)], fill=INK, width=1)
        draw.line([(cx - s // 2 - 1, cy - 1), (cx - s, cy + s // 2), (cx - s // 2 - 1, cy + s + 1)], fill=INK, width=1)
    else:
        # Centre horizontally on the ink, vertically on the line so '.' and 'g' sit on a common baseline.
        left, _, right, _ = font.getbbox(label)
        _, top, _, bottom = font.getbbox("Hg")
        draw.text((cx - (left + right) / 2, cy - (top + bottom) / 2), label, font=font, fill=INK)

