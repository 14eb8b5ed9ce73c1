"""Characters as axis labels in tinychar's pictures (the attention heatmaps): whitespace made visible, characters the
font has no glyph for shown by their code point, and each label centred on its cell. Drawn with Pillow.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # run as a file (python lab/labels.py): the project's packages are one folder up
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from PIL import ImageDraw, ImageFont

INK = (40, 40, 40)

# Symbols the default font has no glyph for; they are drawn as small line figures instead.
SPACE, NEWLINE, TAB = "␣", "↵", "→"


def display_char(ch: str) -> str:
    """How a character is written on an axis: whitespace made visible, other control characters escaped."""
    if ch == " ":
        return SPACE
    if ch == "\n":
        return NEWLINE
    if ch == "\t":
        return TAB
    if ch.isprintable():
        return ch
    return ch.encode("unicode_escape").decode("ascii")  # '\r', '\x00', '\u200b', ...


def font_of(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
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
    missing = font.getmask("\uffff")  # a non-character: always the font's "no glyph" box
    mask = font.getmask(label)
    if mask.size == missing.size and bytes(mask) == bytes(missing):
        return f"U+{ord(label):04X}"
    return label


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


if __name__ == "__main__":
    from lab import not_a_command

    raise SystemExit(not_a_command("lab/labels.py"))
