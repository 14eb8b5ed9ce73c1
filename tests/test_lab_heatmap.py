"""Attention heatmaps: the weights they read from the model, and what the picture shows at given pixels."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest
import torch
from PIL import Image, features

from lab import labels
from lab.heatmap import (
    EMPTY_COLOUR,
    MAX_MAP_PIXELS,
    attention_weights,
    characters_shown,
    colour_at,
    display_char,
    grid_layout,
    render_attention_grid,
    render_attention_map,
    save_attention_map,
    value_ink,
    value_pixels,
)
from lab.pictures import image_format, log_image, picture_target, write_picture
from model import GPT, GPTConfig

VOCAB = list("\n !,.:?abcdefghijklmnopqrstuvwxyz")


def tiny(block_size: int = 8) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=len(VOCAB), block_size=block_size, n_layer=2, n_head=3, n_embd=24)
    return GPT(config)


def ids_of(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text]


def causal_weights(n_layer: int, n_head: int, T: int, seed: int = 0) -> list[torch.Tensor]:
    """Random attention-like weights: each row a softmax over the visible keys, the future exactly 0."""
    g = torch.Generator().manual_seed(seed)
    future = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)
    return [
        torch.softmax(torch.randn(n_head, T, T, generator=g).masked_fill(future, float("-inf")), dim=-1)
        for _ in range(n_layer)
    ]


def pixel(image: Image.Image, xy: tuple[int, int]) -> tuple[int, int, int]:
    return image.getpixel(xy)


def test_weights_have_one_causal_distribution_per_query():
    model = tiny()
    weights = attention_weights(model, ids_of("hello, world"))
    assert len(weights) == 2
    for w in weights:
        assert w.shape == (3, 8, 8)
        assert w.device.type == "cpu" and w.dtype == torch.float32
        torch.testing.assert_close(w.sum(dim=-1), torch.ones(3, 8))
        assert torch.all(w.triu(diagonal=1) == 0)
        torch.testing.assert_close(w[:, 0, 0], torch.ones(3))  # the first query can only see itself


@pytest.mark.parametrize("training", [True, False])
def test_training_flag_is_restored(training):
    model = tiny().train(training)
    attention_weights(model, ids_of("abc"))
    assert model.training is training
    assert all(m.training is training for m in model.modules())


def test_only_the_last_block_size_ids_are_used():
    model = tiny()
    long = ids_of("the quick brown fox, the lazy dog.")
    last = attention_weights(model, long)
    window = attention_weights(model, long[-8:])
    for a, b in zip(last, window, strict=True):
        torch.testing.assert_close(a, b)
    short = attention_weights(model, torch.tensor(ids_of("hey")))
    assert short[0].shape == (3, 3, 3)


def test_weights_refuse_a_batch_or_an_empty_sequence():
    model = tiny()
    with pytest.raises(ValueError, match="one non-empty sequence"):
        attention_weights(model, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="one non-empty sequence"):
        attention_weights(model, [])


def test_image_grows_with_layers_down_and_heads_across():
    chars = list("abcdefgh")
    one = render_attention_grid(causal_weights(1, 1, 8), chars)
    taller = render_attention_grid(causal_weights(3, 1, 8), chars)
    wider = render_attention_grid(causal_weights(1, 3, 8), chars)
    assert one.mode == "RGB"
    assert taller.height > one.height and taller.width == one.width
    assert wider.width > one.width and wider.height == one.height


def test_masked_future_is_empty_and_weights_take_the_colour_map():
    T = 4
    weights = causal_weights(2, 2, T)
    weights[1][1, 2] = torch.tensor([0.0, 0.5, 0.5, 0.0])  # layer 1, head 1, query 2: nothing on key 0
    chars = list("ab c")
    image = render_attention_grid(weights, chars, title="synthetic")
    layout = grid_layout(2, 2, chars, title="synthetic")
    assert image.size == (layout.width, layout.height)
    for layer in range(2):
        for head in range(2):
            for q in range(T):
                for k in range(q + 1, T):  # every masked square, every head
                    assert pixel(image, layout.position_centre(layer, head, q, k)) == EMPTY_COLOUR
            assert pixel(image, layout.position_centre(layer, head, 0, 0)) == colour_at(1.0)
    assert pixel(image, layout.position_centre(1, 1, 2, 0)) == colour_at(0.0)
    assert pixel(image, layout.position_centre(1, 1, 2, 1)) == colour_at(0.5)
    assert colour_at(0.0) != EMPTY_COLOUR and colour_at(1.0) != colour_at(0.0)


def test_values_write_each_visible_weight_in_its_square_as_the_notes_heatmaps_do():
    """Note 003's heatmap prints every weight in its cell with two decimals; the lab drew colours alone."""
    T = 4
    weights = causal_weights(1, 2, T)
    weights[0][1, 3] = torch.tensor([0.25, 0.25, 0.25, 0.25])  # head 1, query 3: four equal weights
    weights[0][1, 2] = torch.tensor([0.125, 0.25, 0.625, 0.0])
    chars = list("abcd")
    image = render_attention_grid(weights, chars, values=True)
    plain = render_attention_grid(weights, chars)
    layout = grid_layout(1, 2, chars, values=True)
    assert image.size == (layout.width, layout.height) and layout.px >= value_pixels() > grid_layout(1, 2, chars).px

    def square(head: int, q: int, k: int) -> Image.Image:
        x, y = layout.position_centre(0, head, q, k)
        half = layout.px // 2
        return image.crop((x - half + 1, y - half + 1, x + half - 1, y + half - 1))

    for head in range(2):
        for q in range(T):
            for k in range(T):
                colours = {c for _, c in square(head, q, k).getcolors(layout.px**2)}
                if k > q:  # the masked future: nothing written
                    assert colours == {EMPTY_COLOUR}
                else:  # the weight's colour, and the ink of its digits (smoothed at their edges: some pixels at
                    w = float(weights[0][head, q, k])  # least half way from the square's colour to the ink's)
                    ground, ink = colour_at(w), value_ink(w)
                    far = sum((a - b) ** 2 for a, b in zip(ground, ink, strict=True))
                    inked = [c for c in colours if sum((a - b) ** 2 for a, b in zip(c, ink, strict=True)) < far / 4]
                    assert ground in colours and inked, (head, q, k)
    # the same weight writes the same square, another one another
    assert square(1, 3, 0).tobytes() == square(1, 3, 1).tobytes() == square(1, 3, 3).tobytes()
    assert square(1, 2, 1).tobytes() == square(1, 3, 1).tobytes() != square(1, 2, 0).tobytes()
    assert value_ink(0.0) == (255, 255, 255) and value_ink(1.0) != value_ink(0.0)
    # without values every square is its colour alone
    plain_layout = grid_layout(1, 2, chars)
    x, y = plain_layout.position_centre(0, 1, 2, 2)
    half = plain_layout.px // 2
    assert {c for _, c in plain.crop((x - half + 1, y - half + 1, x + half - 1, y + half - 1)).getcolors()} == {
        colour_at(0.625)}


def test_colour_map_runs_dark_to_bright_through_its_ends():
    values = [i / 20 for i in range(21)]
    brightness = [sum(colour_at(v)) for v in values]
    assert brightness == sorted(brightness)
    assert colour_at(-1.0) == colour_at(0.0) and colour_at(2.0) == colour_at(1.0)
    assert all(colour_at(v) != EMPTY_COLOUR for v in values)


def test_model_weights_render_with_position_zero_fully_on_itself():
    model = tiny()
    ids = ids_of("to be, or not")
    weights = attention_weights(model, ids)
    chars = [VOCAB[i] for i in ids[-8:]]
    image = render_attention_grid(weights, chars)
    layout = grid_layout(2, 3, chars)
    for layer in range(2):
        for head in range(3):
            assert pixel(image, layout.position_centre(layer, head, 0, 0)) == colour_at(1.0)
            assert pixel(image, layout.position_centre(layer, head, 0, 7)) == EMPTY_COLOUR


@pytest.mark.parametrize(("n_layer", "n_head", "T"), [(1, 1, 1), (1, 1, 64), (4, 4, 1), (4, 4, 64), (8, 8, 16)])
def test_renders_from_one_to_many_positions_and_heads(n_layer, n_head, T):
    chars = [VOCAB[i % len(VOCAB)] for i in range(T)]
    image = render_attention_grid(causal_weights(n_layer, n_head, T), chars)
    layout = grid_layout(n_layer, n_head, chars)
    assert image.size == (layout.width, layout.height)
    assert 6 <= layout.px <= 20
    last = (n_layer - 1, n_head - 1)
    assert pixel(image, layout.position_centre(*last, 0, 0)) == colour_at(1.0)
    if T > 1:
        assert pixel(image, layout.position_centre(*last, 0, T - 1)) == EMPTY_COLOUR
    _, _, x1, y1 = layout.heatmap_box(*last)
    assert x1 <= image.width and y1 <= image.height


def test_cells_shrink_with_length_and_labels_thin_out():
    assert grid_layout(1, 1, list("abcdefgh")).px == 20
    middle, long = grid_layout(1, 1, ["a"] * 32), grid_layout(1, 1, ["a"] * 64)
    assert 20 > middle.px > long.px >= 6
    assert middle.row_stride == 1 and middle.col_stride == 1
    assert long.row_stride > 1  # a 10 px font does not fit on rows this narrow: every other character
    assert grid_layout(1, 1, list("abcdefgh")).row_stride == 1


def test_whitespace_and_control_characters_are_visible():
    assert display_char(" ") == "␣"
    assert display_char("\n") == "↵"
    assert display_char("\t") == "→"
    assert display_char("\x00") == "\\x00"
    assert display_char("\r") == "\\r"
    assert display_char("q") == "q"
    image = render_attention_grid(causal_weights(1, 1, 6), [" ", "\n", "\t", "\x00", "é", "中"])
    assert image.mode == "RGB"


def test_the_whitespace_symbols_written_in_the_text_are_labelled_apart_from_whitespace():
    # a real '→' in the text was labelled as a tab is, and '␣', '↵' as a space and a newline: the same drawn figure
    axis_font = labels.fonts(20)[0]
    shown = {c: labels.legible(axis_font, display_char(c)) for c in " \n\t␣↵→"}
    assert [shown[c] for c in " \n\t"] == [labels.SPACE, labels.NEWLINE, labels.TAB]  # drawn as line figures
    assert [shown[c] for c in "␣↵→"] == ["U+2423", "U+21B5", "U+2192"]
    assert len(set(shown.values())) == 6
    render_attention_grid(causal_weights(1, 1, 6), list(" \n\t␣↵→"))


def test_combining_marks_and_invisible_characters_are_labelled_by_their_code_points():
    # A Devanagari vowel sign or virama was drawn as a dotted circle and a box (the missing-glyph check does not
    # catch a lone mark), a joiner as '\u200d' beside the U+ codes of the rest
    assert [display_char(c) for c in "\u094d\u0947\u064e\u0301\u200d\u200b"] == [
        "U+094D", "U+0947", "U+064E", "U+0301", "U+200D", "U+200B"]
    assert [display_char(c) for c in "\r\x00é"] == ["\\r", "\\x00", "é"]  # controls keep their escapes
    title_font = labels.fonts(20)[2]
    assert labels.legible_text(title_font, "नमस्ते") == "<U+0928><U+092E><U+0938><U+094D><U+0924><U+0947>"
    render_attention_grid(causal_weights(1, 1, 4), list("न\u094dते"), title="नमस्ते")


def test_a_title_in_characters_the_font_lacks_is_drawn_as_their_code_points():
    """sample.py's title names the prompt: a Chinese one was a row of identical empty boxes."""
    weights = causal_weights(1, 1, 4)
    as_code_points = "run: '<U+4E2D><U+6587>'"
    for title in ("run: '中文'", as_code_points):
        assert labels.legible_text(labels.fonts(20)[2], title) == as_code_points
    drawn = render_attention_grid(weights, list("abcd"), title="run: '中文'")
    assert drawn.tobytes() == render_attention_grid(weights, list("abcd"), title=as_code_points).tobytes()
    assert drawn.tobytes() != render_attention_grid(weights, list("abcd"), title="run: '??'").tobytes()
    one = render_attention_map(torch.full((2, 2), 0.5), ["a", "b"], ["c", "d"], title="中")
    assert one.tobytes() == render_attention_map(torch.full((2, 2), 0.5), ["a", "b"], ["c", "d"],
                                                 title="<U+4E2D>").tobytes()


@pytest.mark.skipif(labels._wide_font_path() is None, reason="no DejaVu Sans or Arial on this system")
def test_accented_latin_greek_and_cyrillic_are_drawn_as_themselves_where_the_system_has_a_wide_font(monkeypatch):
    font = labels.font_of(14)
    assert [labels.legible(font, c) for c in "éßΩж中"] == ["é", "ß", "Ω", "ж", "U+4E2D"]
    assert labels.legible_text(font, "café") == "café"
    monkeypatch.setattr(labels, "_wide_font_path", lambda: None)  # Pillow's own font: ASCII only
    assert labels.legible(labels.font_of(14), "é") == "U+00E9"


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="layer 1"):
        render_attention_grid([torch.ones(2, 3, 3), torch.ones(2, 4, 4)], list("abc"))
    with pytest.raises(ValueError, match="at least one layer"):
        render_attention_grid([], list("abc"))


def test_save_writes_a_png_of_the_last_window(tmp_path: Path):
    model = tiny()
    path = save_attention_map(model, ids_of("first citizen:\nhear me"), VOCAB, tmp_path / "maps" / "a.png", title="t")
    assert path == tmp_path / "maps" / "a.png"
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.load()
        expected = render_attention_grid(attention_weights(model, ids_of("n:\nhear me")), list("n:\nhear me")[-8:], "t")
        assert image.size == expected.size
        assert image.tobytes() == expected.tobytes()


def test_logged_image_is_the_picture_itself(tmp_path):
    """log_image writes the picture to TensorBoard as a PNG that decodes to the same pixels, at the given step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from training.events import EventWriter

    image = render_attention_grid(causal_weights(2, 3, 8), list("abcdefgh"), title="step 7")
    writer = EventWriter(tmp_path)
    log_image(writer, "attention/grid", image, 7)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    (logged,) = events.Images("attention/grid")
    assert (logged.step, logged.width, logged.height) == (7, image.width, image.height)
    with Image.open(io.BytesIO(logged.encoded_image_string)) as png:
        assert png.format == "PNG" and png.mode == "RGB"
        assert png.tobytes() == image.tobytes()

def test_a_picture_too_large_to_open_shows_the_last_characters_that_fit(tmp_path: Path, monkeypatch):
    # a window whose picture would pass MAX_MAP_PIXELS (where Pillow would refuse to open it again) is drawn over its
    # last characters instead, as many as fit
    import lab.heatmap

    text = "first citizen:\nbefore we proceed any further, hear me speak."
    chars = list(text)
    whole = grid_layout(2, 3, chars, "t")
    assert lab.heatmap.characters_shown(2, 3, chars, "t") == len(chars)  # far below the real limit
    limit = whole.width * whole.height // 3
    shown = lab.heatmap.characters_shown(2, 3, chars, "t", limit=limit)
    assert 1 <= shown < len(chars)
    fitting, one_more = grid_layout(2, 3, chars[-shown:], "t"), grid_layout(2, 3, chars[-shown - 1 :], "t")
    assert fitting.width * fitting.height <= limit < one_more.width * one_more.height
    monkeypatch.setattr(lab.heatmap, "MAX_MAP_PIXELS", limit)
    model = tiny(block_size=64)
    path = save_attention_map(model, ids_of(text), VOCAB, tmp_path / "a.png", title="t")
    with Image.open(path) as image:
        image.load()
        expected = render_attention_grid(attention_weights(model, ids_of(text[-shown:])), chars[-shown:], "t")
        assert image.tobytes() == expected.tobytes()


def test_a_model_whose_picture_of_one_character_is_too_large_gets_none(tmp_path: Path, monkeypatch):
    # 3,000 layers x 64 heads: one character's picture is about 2 billion pixels (6 GB of RGB); none is drawn
    import lab.heatmap

    one = grid_layout(3000, 64, ["a"], "t")
    assert one.width * one.height > MAX_MAP_PIXELS
    assert characters_shown(3000, 64, list("abc"), "t") == 0
    assert characters_shown(2, 3, [], "t") == 0
    model = tiny()
    small = grid_layout(model.config.n_layer, model.config.n_head, ["a"], "t")
    monkeypatch.setattr(lab.heatmap, "MAX_MAP_PIXELS", small.width * small.height - 1)
    drawn = []
    monkeypatch.setattr(lab.heatmap, "render_attention_grid", lambda *a, **k: drawn.append(1))
    with pytest.raises(ValueError, match="over .* pixels even for one character"):
        save_attention_map(model, ids_of("hear me"), VOCAB, tmp_path / "a.png", title="t")
    assert not drawn and not (tmp_path / "a.png").exists()


@pytest.mark.parametrize(("name", "kind"), [("a.jpg", "JPEG"), ("a.JPEG", "JPEG"), ("a.webp", "WEBP"),
                                            ("a.gif", "GIF"), ("no_extension", "PNG"), ("a.png", "PNG")])
def test_the_picture_is_written_in_the_format_its_name_says(tmp_path: Path, name, kind):
    assert image_format(name) == kind
    path = save_attention_map(tiny(), ids_of("hear me"), VOCAB, tmp_path / name, title="t")
    with Image.open(path) as image:
        assert image.format == kind
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no temporary file left beside it


@pytest.mark.parametrize("name", ["a.xyz", "a.psd", "map.png.gz", "a.xbm", "a.h5"])
def test_a_name_pillow_cannot_write_is_refused_before_drawing(tmp_path: Path, name):
    # .xbm (black and white only) and .h5 (no plugin) were refused only by the write, after the drawing (and in lab
    # sort, after the training)
    with pytest.raises(ValueError, match="Pillow cannot write '.*' pictures(; | in colour .*; )name it .png"):
        image_format(name)
    with pytest.raises(ValueError, match="Pillow cannot write"):
        save_attention_map(tiny(), ids_of("hear me"), VOCAB, tmp_path / name)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("name", "says"), [("map.ico", "shrunk to at most 256 x 256"), ("map.ICNS", "stretched")])
def test_an_icon_format_is_refused_before_drawing(tmp_path: Path, name, says):
    # the heatmap came out as a 256-pixel icon (.ico) or a square one (.icns), saved without a word
    with pytest.raises(ValueError, match=f"is an icon format, which Pillow writes {says}.*; name it .png"):
        image_format(name)
    with pytest.raises(ValueError, match="is an icon format"):
        save_attention_map(tiny(), ids_of("hear me"), VOCAB, tmp_path / name)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not features.check("jpg_2000"), reason="Pillow built without OpenJPEG")
def test_a_j2k_picture_is_the_raw_codestream_and_no_picture_holds_the_temporary_name(tmp_path: Path):
    # Written through '.NAME.j2k.<pid>.part', a .j2k got a JP2 container (Pillow picks the codestream by the name's
    # ending), and an SGI picture's header held that temporary name
    image = Image.new("RGB", (6, 5), (200, 30, 60))
    codestream = b"\xff\x4f\xff\x51"
    for name, starts in (("a.j2k", codestream), ("a.J2C", codestream), ("a.jpc", codestream),
                         ("a.jp2", b"\x00\x00\x00\x0cjP  \r\n\x87\n"), ("a.sgi", b"\x01\xda"), ("a.rgb", b"\x01\xda")):
        written = write_picture(image, tmp_path / name).read_bytes()
        assert written.startswith(starts) and b".part" not in written, name
        expected = io.BytesIO()  # the format's bytes, nothing of the file's name in them
        image.save(expected, format=image_format(name), no_jp2=starts == codestream)
        assert written == expected.getvalue(), name
        with Image.open(tmp_path / name) as back:
            assert back.mode == "RGB" and back.getpixel((0, 0)) == (200, 30, 60)


@pytest.mark.parametrize(("name", "says"), [("map.pbm", "a black-and-white bitmap"), ("map.PGM", "a greyscale map"),
                                            ("map.pfm", "a map of floating-point numbers"),
                                            ("map.bw", "a greyscale SGI picture")])
def test_a_name_that_promises_less_than_colour_is_refused_before_drawing(tmp_path: Path, name, says):
    # Pillow wrote a colour pixmap (P6) into .pbm, .pgm and .pfm, and a colour SGI file into .bw, whatever the name
    suffix = Path(name).suffix.lower()
    with pytest.raises(ValueError, match=f"a '{suffix}' file is {says}, but Pillow writes a colour .*; name it .png"):
        image_format(name)
    with pytest.raises(ValueError, match="but Pillow writes a colour"):
        save_attention_map(tiny(), ids_of("hear me"), VOCAB, tmp_path / name)
    assert list(tmp_path.iterdir()) == []
    assert image_format("map.ppm") == "PPM"  # the colour pixmap's own name


@pytest.mark.parametrize("name", ["é.im", "map.IM"])
def test_a_format_pillow_is_dropping_is_refused_before_drawing(tmp_path: Path, name):
    # .im with a name in other letters passed the check and failed after the drawing (lab sort: after the training):
    # "'ascii' codec can't encode", Pillow writing the file's name into the format's ASCII header
    with pytest.raises(ValueError, match=r"'.im' is a format Pillow is dropping \(deprecated, and gone in Pillow 15\), "
                                         r".*; name it .png"):
        image_format(name)
    with pytest.raises(ValueError, match="Pillow is dropping"):
        save_attention_map(tiny(), ids_of("hear me"), VOCAB, tmp_path / name)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["map.pdf", "map.PALM"])
def test_a_format_pillow_cannot_read_back_is_refused_before_drawing(tmp_path: Path, name):
    # a .pdf was written once, and the same command then refused it: "a file that is not a picture is there"
    with pytest.raises(ValueError, match=r"Pillow writes '.*' files but cannot read them back, .*; name it .png"):
        image_format(name)
    assert list(tmp_path.iterdir()) == []


def test_replacing_one_of_its_own_largest_pictures_warns_of_nothing(tmp_path: Path, recwarn):
    # a picture past Pillow's warning size (tinychar draws up to 179M pixels) gave a DecompressionBombWarning, twice
    big = tmp_path / "big.png"
    Image.new("L", (12_000, 12_000)).save(big)  # past the warning size (89M pixels), under the error (179M)
    assert picture_target(big)[0] == big
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]


def test_a_failed_write_leaves_no_half_picture(tmp_path: Path, monkeypatch):
    def full_disk(src: object, dst: object) -> None:  # the picture is in its temporary file, and cannot take its place
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        save_attention_map(tiny(), ids_of("hear me"), VOCAB, tmp_path / "a.png")
    assert list(tmp_path.iterdir()) == []


def _loop(folder: Path) -> Path:
    (folder / "loop1").symlink_to(folder / "loop2")
    (folder / "loop2").symlink_to(folder / "loop1")
    return folder / "loop1"


@pytest.mark.parametrize(("make", "says"), [
    (lambda t: (t / "ckpt.png").write_bytes(b"PK\x03\x04 a checkpoint"), "a file that is not a picture is there"),
    (lambda t: (t / "no_extension").write_text("12345\n"), "a file that is not a picture is there"),  # a run's .lock
    (lambda t: os.mkfifo(t / "fifo.png"), "it is not a plain file (a device, a pipe or a socket)"),
    (lambda t: (t / "folder.png").mkdir(), "it is a folder; give a file name such as"),
    (lambda t: _loop(t), "a loop of symbolic links is on the way there"),
], ids=["a checkpoint", "a lock file", "a pipe", "a folder", "a loop of links"])
def test_a_picture_never_replaces_what_is_not_a_picture(tmp_path: Path, make, says):
    # The picture is renamed over its path: over a checkpoint or a run's .lock named by a slip of the command line,
    # or over /dev/null itself for a run as root, which sample.py --attention-map and lab sort --heatmap both did.
    make(tmp_path)
    before = {p.name: (p.is_symlink(), p.is_file() and p.read_bytes()) for p in tmp_path.iterdir()}
    (name,) = before if len(before) == 1 else ["loop1"]
    target = tmp_path / name / "x.png" if name == "loop1" else tmp_path / name
    with pytest.raises(ValueError, match=re.escape(says)):
        picture_target(target)
    with pytest.raises(ValueError, match=re.escape(says)):
        save_attention_map(tiny(), ids_of("hear me"), VOCAB, target)
    assert {p.name: (p.is_symlink(), p.is_file() and p.read_bytes()) for p in tmp_path.iterdir()} == before


def test_a_picture_replaces_a_picture_or_an_empty_file_and_writes_through_a_link(tmp_path: Path):
    Image.new("RGB", (2, 2)).save(tmp_path / "old.png")
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "link.png").symlink_to(tmp_path / "old.png")
    for name in ("old.png", "empty.png"):
        assert save_attention_map(tiny(), ids_of("hear me"), VOCAB, tmp_path / name) == tmp_path / name
        with Image.open(tmp_path / name) as image:
            assert image.size != (2, 2)
    Image.new("RGB", (2, 2)).save(tmp_path / "old.png")
    assert save_attention_map(tiny(), ids_of("hear me"), VOCAB, tmp_path / "link.png") == tmp_path / "old.png"
    assert (tmp_path / "link.png").is_symlink()  # the link stays; the picture it leads to is the new one
    with Image.open(tmp_path / "link.png") as image:
        assert image.size != (2, 2)


@contextlib.contextmanager
def descriptor_into(fd: int, path: Path):
    """Descriptor fd (1: stdout, 2: stderr) writing to the file at path, as the shell's `> path` leaves it."""
    saved = os.dup(fd)
    with open(path, "wb") as file:
        os.dup2(file.fileno(), fd)
    try:
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


@pytest.mark.parametrize(("fd", "stream"), [(1, "stdout"), (2, "stderr")])
def test_a_picture_never_replaces_the_file_the_commands_output_goes_to(tmp_path: Path, fd, stream):
    # `sample.py --attention-map /dev/stdout > samples.txt`: the shell's empty samples.txt passed for an empty file a
    # picture may replace; it became the picture, and the samples went to the old, unlinked file
    out = tmp_path / "out.png"
    for name in (f"/dev/{stream}", f"/proc/self/fd/{fd}", str(out)):
        with descriptor_into(fd, out), pytest.raises(ValueError, match=re.escape(
                f"it is where this command's output ({stream}) is written, which the picture would replace; name a "
                f"picture file")):
            save_attention_map(tiny(), ids_of("hear me"), VOCAB, name)
        assert out.read_bytes() == b"" and list(tmp_path.iterdir()) == [out]
    with descriptor_into(fd, tmp_path / "out.txt"):
        assert picture_target(out) == (out, "PNG")  # another empty file: replaced as before


def test_values_that_are_not_finite_have_a_colour_of_their_own_and_the_legend_names_it():
    # nan was painted as 0 (the weights of a run whose training diverged drew a map of zeros) and inf as 1
    from lab.colours import NOT_FINITE_COLOUR, colourise

    def count(image: Image.Image, colour: tuple[int, int, int]) -> int:
        rgb = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(-1, 3)
        return int((rgb == torch.tensor(colour, dtype=torch.uint8)).all(-1).sum())

    on_the_map = {colour_at(v / 100) for v in range(101)}
    assert NOT_FINITE_COLOUR not in on_the_map and NOT_FINITE_COLOUR != EMPTY_COLOUR
    rgb = colourise(torch.tensor([0.0, float("nan"), float("inf"), -float("inf"), 1.0]))
    assert [tuple(c) for c in rgb.tolist()] == [colour_at(0.0), *[NOT_FINITE_COLOUR] * 3, colour_at(1.0)]
    assert colour_at(float("nan")) == NOT_FINITE_COLOUR
    T, chars = 4, list("ab c")
    weights = causal_weights(2, 2, T)
    finite = render_attention_grid(weights, chars)
    weights[1][1, 2] = torch.tensor([float("nan"), 0.5, 0.5, 0.0])
    image = render_attention_grid(weights, chars)
    layout = grid_layout(2, 2, chars)
    assert pixel(image, layout.position_centre(1, 1, 2, 0)) == NOT_FINITE_COLOUR
    assert pixel(image, layout.position_centre(1, 1, 2, 1)) == colour_at(0.5)
    assert count(finite, NOT_FINITE_COLOUR) == 0 and image.size == finite.size
    # the cell, and a legend's swatch beside "nan or inf" (14 x 14 pixels, less its frame)
    assert count(image, NOT_FINITE_COLOUR) >= layout.px**2 + 12 * 12
    rows = torch.tensor([[1.0, 0.0, 0.0], [float("nan")] * 3])
    plain = render_attention_map(rows.nan_to_num(0.0), ["1", "3"], ["3", "1", "3"])
    image = render_attention_map(rows, ["1", "3"], ["3", "1", "3"])
    assert count(plain, NOT_FINITE_COLOUR) == 0 and image.height > plain.height
    assert count(image, NOT_FINITE_COLOUR) >= 3 * 16 * 16 + 12 * 12
