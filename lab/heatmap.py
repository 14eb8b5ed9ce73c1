"""Attention heatmaps: one picture of every head's weights over a window of characters.

``save_attention_map(model, ids, chars, path)`` runs the model on the last ``block_size`` ids and writes a PNG
grid, rows = layers, columns = heads. Each cell shows one head's (T, T) weights: query characters down the left,
key characters along the top, the future (upper triangle) drawn as empty grey, a colour bar from 0 to 1 beside.

Drawn with Pillow (not matplotlib: colours are interpolated here), which is why this lives in lab/ and not in
model/, whose code imports only torch. train.py logs the same grid to TensorBoard; sample.py --attention-map saves
it as a PNG.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a file (python lab/heatmap.py): the project's packages are one folder up
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # functions, not a command: said at once, before the seconds of importing torch
    from lab import not_a_command

    raise SystemExit(not_a_command("lab/heatmap.py"))

import torch
from PIL import Image, ImageDraw, ImageFont
from torch import nn

from lab.colours import (
    CBAR_W,
    EMPTY_COLOUR,
    FRAME,
    NOT_FINITE_COLOUR,
    NOT_FINITE_LABEL,
    colour_at,
    colour_scale,
    colourise,
    swatch,
)
from lab.labels import (
    INK,
    display_char,
    draw_label,
    font_of,
    fonts,
    label_width,
    legible,
    legible_text,
    text_size,
)
from lab.pictures import picture_target, write_picture

BACKGROUND = (255, 255, 255)
MARGIN, GAP = 12, 18  # outer margin, space between cells (px)
# The weights written in their squares (values=True), as the notes' heatmaps print them: two decimals in a font of
# VALUE_FONT_PX pixels, dark on the light end of the map and white on the dark end.
VALUE_FONT_PX = 10


def attention_weights(model: nn.Module, ids: list[int] | torch.Tensor) -> list[torch.Tensor]:
    """Each layer's attention weights (n_head, T, T) on CPU, T = min(len(ids), block_size), for the last ids.

    The model runs in eval mode (no dropout, so every row sums to 1) without gradients; its training flag is
    restored afterwards.
    """
    device = next(model.parameters()).device
    idx = torch.tensor(_last_window(ids, model.config.block_size), device=device).unsqueeze(0)  # (1, T)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _, _, weights = model(idx, return_attention=True)  # per layer (1, nh, T, T)
    finally:
        model.train(was_training)
    return [w[0].float().cpu().contiguous() for w in weights]


def _last_window(ids: list[int] | torch.Tensor, block_size: int) -> list[int]:
    """The last block_size ids of one sequence, given as a list, a (T,) tensor or a (1, T) tensor."""
    idx = torch.as_tensor(ids, dtype=torch.long)
    if idx.dim() == 2 and idx.size(0) == 1:
        idx = idx[0]
    if idx.dim() != 1 or idx.numel() == 0:
        raise ValueError(f"expected one non-empty sequence of ids, got shape {tuple(idx.shape)}")
    return idx[-block_size:].tolist()


@dataclass(frozen=True)
class GridLayout:
    """Pixel geometry of an attention grid, shared by the renderer and anyone who needs to find a cell."""

    n_layer: int
    n_head: int
    T: int
    px: int  # pixels per position in a heatmap
    left: int  # width of the query-character column left of each heatmap
    top: int  # height of the cell label plus the key-character row above each heatmap
    cell_w: int  # width of one grid cell, heatmap and margins included
    cell_h: int
    origin: tuple[int, int]  # top-left corner of the grid (below the title)
    width: int
    height: int
    row_stride: int  # label every row_stride-th query, counted back from the newest character
    col_stride: int  # the same for keys; a key label that would overlap its neighbour is left out as well

    def heatmap_box(self, layer: int, head: int) -> tuple[int, int, int, int]:
        """(x0, y0, x1, y1) of one head's heatmap, x1 and y1 exclusive."""
        x0 = self.origin[0] + head * self.cell_w + self.left
        y0 = self.origin[1] + layer * self.cell_h + self.top
        return x0, y0, x0 + self.T * self.px, y0 + self.T * self.px

    def position_centre(self, layer: int, head: int, query: int, key: int) -> tuple[int, int]:
        """(x, y) of the centre of the square for weight [query, key] of one head."""
        x0, y0, _, _ = self.heatmap_box(layer, head)
        return x0 + key * self.px + self.px // 2, y0 + query * self.px + self.px // 2


def cell_pixels(T: int) -> int:
    """Pixels per position: 20 at T <= 8, then shrinking as 1/sqrt(T) (10 at T=32, 7 at T=64), never below 6.

    Shrinking slower than 1/T lets a longer window take a bigger picture, so its characters stay labelled.
    """
    return max(6, min(20, round(20 * math.sqrt(8 / max(T, 1)))))


def value_pixels() -> int:
    """The side of a square that holds a weight written with two decimals (values=True)."""
    width, height = text_size(font_of(VALUE_FONT_PX), "0.00")
    return max(width, height) + 6


def grid_layout(n_layer: int, n_head: int, chars: list[str], title: str | None = None,
                values: bool = False) -> GridLayout:
    """Where everything goes in ``render_attention_grid`` for this many layers, heads and characters (with values,
    squares large enough to hold the weights written in them)."""
    T = len(chars)
    px = max(cell_pixels(T), value_pixels()) if values else cell_pixels(T)
    axis_font, label_font, title_font = fonts(px)
    title = legible_text(title_font, title) if title else title
    labels = [legible(axis_font, display_char(c)) for c in chars]
    widths = [label_width(axis_font, s) for s in labels]
    char_h = text_size(axis_font, "Hg")[1]
    # A row label needs one line; a column label the width of a single character. Wide labels (escapes such as
    # '\x00') do not thin out every column: the renderer skips the ones that would overlap instead.
    row_stride = math.ceil(char_h / px)
    col_stride = math.ceil((max([w for w, s in zip(widths, labels, strict=True) if len(s) == 1], default=1) + 2) / px)
    left = max(widths) + 8
    top = text_size(label_font, "layer 0, head 0")[1] + 6 + char_h + 6
    label_w = text_size(label_font, f"layer {n_layer - 1}, head {n_head - 1}")[0]
    cell_w = max(left + T * px, label_w) + GAP
    cell_h = top + T * px + GAP
    title_h = text_size(title_font, title)[1] + 12 if title else 0
    origin = (MARGIN, MARGIN + title_h)
    cbar_h = max(T * px, 100)
    legend_w = CBAR_W + 8 + text_size(label_font, "future (masked)")[0]
    width = origin[0] + n_head * cell_w + max(legend_w, CBAR_W + 40) + MARGIN
    height = origin[1] + max(n_layer * cell_h, top + cbar_h + 40) + MARGIN
    if title:
        width = max(width, text_size(title_font, title)[0] + 2 * MARGIN)
    return GridLayout(n_layer, n_head, T, px, left, top, cell_w, cell_h, origin, width, height, row_stride, col_stride)


def _key_positions(widths: list[int], px: int, stride: int) -> list[int]:
    """Key positions to label: every stride-th from the newest back, skipping any that would overlap the last."""
    T = len(widths)
    chosen, left_edge = [], math.inf
    for t in range(T - 1, -1, -stride):
        centre = t * px + px / 2
        if centre + widths[t] / 2 + 2 <= left_edge:
            chosen.append(t)
            left_edge = centre - widths[t] / 2
    return chosen


def render_attention_grid(weights: list[torch.Tensor], chars: list[str], title: str | None = None,
                          values: bool = False) -> Image.Image:
    """A white RGB image of every head's attention: rows = layers (from 0), columns = heads (from 0).

    weights: one (n_head, T, T) tensor per layer, row = query position, column = key position; chars: the T
    characters of the window. Cells above the diagonal (the future a query cannot see) are drawn in
    ``EMPTY_COLOUR``, which no weight maps to, so a masked position never passes for a weight of 0. values: each
    weight written in its square with two decimals (value_ink says in which colour).
    """
    if not weights:
        raise ValueError("render_attention_grid needs the weights of at least one layer")
    weights = [w[0] if w.dim() == 4 and w.size(0) == 1 else w for w in weights]
    n_head, T = weights[0].size(0), len(chars)
    if T == 0:
        raise ValueError("render_attention_grid needs at least one character")
    for i, w in enumerate(weights):
        if w.dim() != 3 or tuple(w.shape) != (n_head, T, T):
            raise ValueError(
                f"layer {i}: weights must be (n_head, T, T) = ({n_head}, {T}, {T}) for {T} characters, "
                f"got {tuple(w.shape)}"
            )
    layout = grid_layout(len(weights), n_head, chars, title, values)
    px = layout.px
    value_font = font_of(VALUE_FONT_PX) if values else None
    axis_font, label_font, title_font = fonts(px)
    title = legible_text(title_font, title) if title else title
    labels = [legible(axis_font, display_char(c)) for c in chars]
    widths = [label_width(axis_font, s) for s in labels]
    keys = _key_positions(widths, px, layout.col_stride)
    queries = range(T - 1, -1, -layout.row_stride)  # the newest character is always labelled
    char_h = text_size(axis_font, "Hg")[1]

    image = Image.new("RGB", (layout.width, layout.height), BACKGROUND)
    draw = ImageDraw.Draw(image)
    if title:
        draw.text((MARGIN, MARGIN), title, font=title_font, fill=INK)
    future = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)  # (T, T): key after query
    for layer, w in enumerate(weights):
        rgb = colourise(w)  # (nh, T, T, 3)
        rgb[:, future] = torch.tensor(EMPTY_COLOUR, dtype=torch.uint8)
        for head in range(n_head):
            x0, y0, x1, y1 = layout.heatmap_box(layer, head)
            draw.text((x0 - layout.left, y0 - layout.top), f"layer {layer}, head {head}", font=label_font, fill=INK)
            heat = Image.frombytes("RGB", (T, T), bytes(rgb[head].flatten().tolist()))
            image.paste(heat.resize((T * px, T * px), Image.Resampling.NEAREST), (x0, y0))
            draw.rectangle((x0 - 1, y0 - 1, x1, y1), outline=FRAME)
            if value_font is not None:
                _write_values(draw, w[head], layout.position_centre(layer, head, 0, 0), px, value_font)
            for t in keys:  # key characters along the top
                cx = x0 + t * px + px / 2
                draw_label(draw, labels[t], cx, y0 - 6 - char_h / 2, axis_font)
                if layout.col_stride > 1 or len(keys) < T:  # a tick says which column a sparse label names
                    draw.line([(cx, y0 - 4), (cx, y0 - 2)], fill=FRAME)
            for t in queries:  # query characters down the left, right-aligned against the heatmap
                cy = y0 + t * px + px / 2
                draw_label(draw, labels[t], x0 - 6 - widths[t] / 2, cy, axis_font)
                if layout.row_stride > 1:
                    draw.line([(x0 - 4, cy), (x0 - 2, cy)], fill=FRAME)
    visible = [w[:, ~future] for w in weights]  # (nh, cells) a layer; the future is drawn grey whatever it holds
    _draw_colour_bar(draw, layout, label_font, not_finite=not all(v.isfinite().all() for v in visible))
    return image


def value_ink(value: float) -> tuple[int, int, int]:
    """The colour a weight is written in on its square: INK where the map is light (from about 0.6 up), else white."""
    return ink_on(*colour_at(value))


def ink_on(r: int, g: int, b: int) -> tuple[int, int, int]:
    """value_ink's colour on a square of colour (r, g, b)."""
    return INK if 0.299 * r + 0.587 * g + 0.114 * b > 140 else BACKGROUND


def _write_values(draw: ImageDraw.ImageDraw, w: torch.Tensor, first: tuple[int, int], px: int,
                  font: ImageFont.ImageFont) -> None:
    """Each weight of one head's (T, T) w on or below the diagonal, with two decimals, centred on its square (the
    square of [0, 0] centred at first)."""
    _, top, _, bottom = font.getbbox("0.00")
    for q, (row, colours) in enumerate(zip(w.tolist(), colourise(w).tolist(), strict=True)):
        for k, (value, colour) in enumerate(zip(row[: q + 1], colours, strict=False)):
            text = f"{value:.2f}"
            left, _, right, _ = font.getbbox(text)
            x, y = first[0] + k * px - (left + right) / 2, first[1] + q * px - (top + bottom) / 2
            draw.text((x, y), text, font=font, fill=ink_on(*colour))


def _draw_colour_bar(draw: ImageDraw.ImageDraw, layout: GridLayout, font: ImageFont.ImageFont,
                     not_finite: bool = False) -> None:
    """A vertical bar from 1 (top) to 0 (bottom) with ticks 0, 0.5, 1, a swatch for the masked future, and one for
    the values that are not finite where there are any (in the bottom margin's first pixels, where the bar is the
    tallest thing in the picture)."""
    x0 = layout.origin[0] + layout.n_head * layout.cell_w
    y0 = layout.origin[1] + layout.top
    h = max(layout.T * layout.px, 100)
    colour_scale(draw, x0, y0, h, font)
    swatch(draw, x0, y0 + h + 12, EMPTY_COLOUR, "future (masked)", font)
    if not_finite:
        swatch(draw, x0, y0 + h + 12 + CBAR_W + 4, NOT_FINITE_COLOUR, NOT_FINITE_LABEL, font)


def render_attention_map(
    weights: torch.Tensor,
    row_labels: list[str],
    column_labels: list[str],
    title: str | None = None,
    rows: str = "query",
    columns: str = "key",
    hidden: torch.Tensor | None = None,
) -> Image.Image:
    """One labelled (Tq, Tk) map of attention weights, such as a decoder's attention over its encoder.

    Row i is query i (labelled row_labels[i], down the left), its colours the weights over the keys (column_labels,
    along the top); rows and columns name the two axes in a caption under the title. Same colours, fonts and
    colour bar as ``render_attention_grid``. hidden (Tk,) marks the keys a mask hides from every query (padding):
    their columns are drawn empty, grey, as the grid draws the future; every other cell is a weight.
    """
    if weights.dim() != 2 or tuple(weights.shape) != (len(row_labels), len(column_labels)) or weights.numel() == 0:
        raise ValueError(f"weights must be (rows, columns) = ({len(row_labels)}, {len(column_labels)}) and non-empty, "
                         f"got {tuple(weights.shape)}")
    Tq, Tk = weights.shape
    axis_font, label_font, title_font = fonts(cell_pixels(max(Tq, Tk)))
    title = legible_text(title_font, title) if title else title
    row_labels = [legible(axis_font, display_char(s)) if len(s) == 1 else s for s in row_labels]
    column_labels = [legible(axis_font, display_char(s)) if len(s) == 1 else s for s in column_labels]
    # Every column is labelled, so a cell is at least as wide as its widest label.
    px = max(cell_pixels(max(Tq, Tk)), max(label_width(axis_font, s) for s in column_labels) + 4)
    char_h = text_size(axis_font, "Hg")[1]
    caption = f"rows: {rows}, columns: {columns}"
    title_h = text_size(title_font, title)[1] + 10 if title else 0
    caption_h = text_size(label_font, caption)[1] + 8
    left = max(label_width(axis_font, s) for s in row_labels) + 10
    x0, y0 = MARGIN + left, MARGIN + title_h + caption_h + char_h + 8
    cbar_h = max(Tq * px, 100)
    width = max(x0 + Tk * px + GAP + CBAR_W + 40, text_size(label_font, caption)[0] + 2 * MARGIN)
    width = max(width, text_size(title_font, title)[0] + 2 * MARGIN) if title else width
    # a swatch under the colour bar says which cells are not finite, where there are any (those a mask hides are grey)
    not_finite = not (weights if hidden is None else weights[:, ~hidden]).isfinite().all()
    if not_finite:
        width = max(width, x0 + Tk * px + GAP + CBAR_W + 6 + text_size(label_font, NOT_FINITE_LABEL)[0] + MARGIN)
    height = y0 + max(Tq * px, cbar_h) + (12 + CBAR_W if not_finite else 0) + MARGIN
    image = Image.new("RGB", (width + MARGIN, height), BACKGROUND)
    draw = ImageDraw.Draw(image)
    if title:
        draw.text((MARGIN, MARGIN), title, font=title_font, fill=INK)
    draw.text((MARGIN, MARGIN + title_h), caption, font=label_font, fill=INK)
    rgb = colourise(weights)  # (Tq, Tk, 3)
    if hidden is not None:
        rgb[:, hidden] = torch.tensor(EMPTY_COLOUR, dtype=torch.uint8)
    heat = Image.frombytes("RGB", (Tk, Tq), bytes(rgb.flatten().tolist()))
    image.paste(heat.resize((Tk * px, Tq * px), Image.Resampling.NEAREST), (x0, y0))
    draw.rectangle((x0 - 1, y0 - 1, x0 + Tk * px, y0 + Tq * px), outline=FRAME)
    for j, label in enumerate(column_labels):
        draw_label(draw, label, x0 + j * px + px / 2, y0 - 6 - char_h / 2, axis_font)
    for i, label in enumerate(row_labels):
        draw_label(draw, label, x0 - 6 - label_width(axis_font, label) / 2, y0 + i * px + px / 2, axis_font)
    colour_scale(draw, x0 + Tk * px + GAP, y0, cbar_h, label_font)
    if not_finite:
        swatch(draw, x0 + Tk * px + GAP, y0 + cbar_h + 12, NOT_FINITE_COLOUR, NOT_FINITE_LABEL, label_font)
    return image


# The most pixels save_attention_map draws: where Pillow refuses to open an image as a decompression bomb (twice its
# warning limit, Image.MAX_IMAGE_PIXELS), so that what it writes can be opened again; and memory stays bounded (a
# 6-layer, 6-head model's picture of 1,000 characters would be 37,000 pixels square, 4 GB). The baby GPT's 256
# characters make 92 million.
MAX_MAP_PIXELS = 178_956_970


def characters_shown(n_layer: int, n_head: int, chars: list[str], title: str | None = None,
                     limit: int | None = None, values: bool = False) -> int:
    """How many of the last of chars a picture of n_layer x n_head heads shows within limit pixels (default
    MAX_MAP_PIXELS); 0 when not even one character fits (a model of thousands of heads), so that no caller draws
    past the bound."""
    limit = MAX_MAP_PIXELS if limit is None else limit

    def fits(n: int) -> bool:
        layout = grid_layout(n_layer, n_head, chars[len(chars) - n :], title, values)
        return layout.width * layout.height <= limit

    if not chars or not fits(1):
        return 0
    low, high = 1, len(chars)
    if fits(high):
        return high
    while low < high - 1:  # fits(low); not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def too_large(n_layer: int, n_head: int, limit: int | None = None) -> str:
    """Why no picture of n_layer x n_head heads is drawn (characters_shown is 0 within limit pixels, by default
    MAX_MAP_PIXELS), for a one-line note."""
    limit = MAX_MAP_PIXELS if limit is None else limit
    return f"a picture of {n_layer:,} layers x {n_head:,} heads is over {limit:,} pixels even for one character"


def save_attention_map(
    model: nn.Module, ids: list[int] | torch.Tensor, chars: list[str], path: str | Path, title: str | None = None,
    values: bool = False,
) -> Path:
    """Render the attention of model on the last block_size ids and write it to path, in the format its extension
    names (image_format; PNG without one): on as many of the last of them as a picture of MAX_MAP_PIXELS shows
    (characters_shown). ValueError when not even one character fits, or the path is refused (picture_target).

    Written by write_picture: no half picture. chars is the vocabulary (id -> character), as stored in checkpoints.
    Returns the path written."""
    picture_target(path)  # refused before the work of drawing
    window = _last_window(ids, model.config.block_size)
    shown = characters_shown(model.config.n_layer, model.config.n_head, [chars[i] for i in window], title,
                             values=values)
    if shown == 0:
        raise ValueError(too_large(model.config.n_layer, model.config.n_head))
    window = window[len(window) - shown :]
    image = render_attention_grid(attention_weights(model, window), [chars[i] for i in window], title, values)
    return write_picture(image, path)

