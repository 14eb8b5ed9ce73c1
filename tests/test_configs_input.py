"""Hostile or careless config input: a key given twice in a YAML file, a bad value blamed on where it really came
from (command line or file), and input of any size or shape (devices, pipes, huge files, YAML aliases that expand
to billions of values, keys with newlines) refused quickly in one short line."""

from __future__ import annotations

import errno
import inspect
import itertools
import os
import socket
import sys
import time
from pathlib import Path

import pytest
from test_configs import TINY, refused, write_yaml

from configs import MAX_CONFIG_BYTES, ConfigError, load_yaml, to_dict
from configs.userinput import QUOTE_LIMIT, read_user_file, resolved, shown
from training.config import load_config

# A message quotes a value in at most ~80 characters; with its own words, one line stays well under this. The tests
# of it name their files by short relative paths (see `here`), so that the temporary folder's length does not count.
SHORT = 300


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ---------------------------------------------------------------------------------------- duplicate keys


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        # a second section would silently replace the first, max_iters and all
        ("train:\n  max_iters: 5\nmodel:\n  n_layer: 2\ntrain:\n  batch_size: 4\n", "'train' twice (lines 1 and 5)"),
        ("train:\n  max_iters: 5\n  batch_size: 4\n  max_iters: 7\n", "'train.max_iters' twice (lines 2 and 4)"),
        ("seed: 1\nout_dir: x\nseed: 2\n", "'seed' twice (lines 1 and 3)"),
        ('seed: 1\n"seed": 2\n', "'seed' twice (lines 1 and 2)"),  # quoting does not make another key
        ("model: {n_layer: 2, n_head: 2, n_layer: 3}\n", "'model.n_layer' twice (both on line 1)"),
        # anywhere in the file, and before any other check
        ("zzz:\n  - {a: 1}\n  - {b: 1, b: 2}\n", "'zzz[1].b' twice (both on line 3)"),
        # a key that merges bring in twice: YAML keeps one of them without a word, PyYAML 6.0.3 the last '<<' and
        # the first of a list, 6.0.4 the first '<<' and the last of a list (named: the lines of the two keys)
        ("a: &x {max_iters: 5}\nb: &y {max_iters: 7}\ntrain:\n  <<: *x\n  <<: *y\n",
         "'train.max_iters' twice (lines 1 and 2); keep one, since merges"),
        ("a: &x {max_iters: 5}\nb: &y {max_iters: 7}\ntrain: {<<: *x, <<: *y}\n",
         "'train.max_iters' twice (lines 1 and 2); keep one, since merges"),
        ("train:\n  <<: [{max_iters: 5},\n       {max_iters: 4}]\n",
         "'train.max_iters' twice (lines 2 and 3); keep one, since merges"),
        ("a: &x {<<: {max_iters: 5}}\ntrain:\n  <<: *x\n  <<: {max_iters: 7}\n",  # merged into what is merged
         "'train.max_iters' twice (lines 1 and 4); keep one, since merges"),
    ],
)
def test_a_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path, text, fragment):
    path = write_yaml(tmp_path, text)
    message = refused(path)
    assert fragment in message and shown(path) in message and "keep one" in message


def test_keys_that_repeat_only_across_mappings_or_by_merging_are_not_duplicates(tmp_path):
    # two mappings with an 'a' each, one mapping reached twice through an alias
    text = "one: [{a: 1}, {a: 2}]\ntwo: &m {a: 3}\nthree: [*m, *m]\n"
    assert load_yaml(write_yaml(tmp_path, text, "lists.yaml")) == {
        "one": [{"a": 1}, {"a": 2}], "two": {"a": 3}, "three": [{"a": 3}, {"a": 3}]}
    merged = "train: {<<: [{max_iters: 5}, {batch_size: 4}], max_iters: 6}\n"  # merge keys; the explicit one wins
    assert load_config(str(write_yaml(tmp_path, merged, "merged.yaml")), []).train.max_iters == 6
    # merges that bring different keys lose nothing, in a list or in two '<<'
    merged = "train:\n  <<: [{max_iters: 5}, {warmup_iters: 4}]\n  <<: {batch_size: 3}\n"
    train = load_config(str(write_yaml(tmp_path, merged, "merges.yaml")), []).train
    assert (train.max_iters, train.warmup_iters, train.batch_size) == (5, 4, 3)


@pytest.mark.parametrize("text", ["data: &d\n  x: *d\n", "train: &t\n  max_iters: 5\n  more: *t\n",
                                  "a: &a {b: *a}\n"])
def test_a_mapping_that_holds_itself_is_one_line(tmp_path, text):
    # `data: &d {x: *d}` recursed without end looking for numbers to keep as written: a RecursionError traceback
    message = refused(write_yaml(tmp_path, text))
    assert "unknown config key" in message and "\n" not in message


def test_a_file_whose_keys_are_all_distinct_loads_every_value(tmp_path):
    text = "seed: 7\nout_dir: here\ndata:\n  val_fraction: 0.2\nmodel:\n  n_layer: 2\ntrain:\n  max_iters: 9\n"
    cfg = load_config(str(write_yaml(tmp_path, text)), [])
    assert (cfg.seed, cfg.out_dir, cfg.data.val_fraction, cfg.model.n_layer, cfg.train.max_iters) == (
        7, "here", 0.2, 2, 9)


# ------------------------------------------------------------------------------------- where a value came from


def test_a_bad_override_is_blamed_on_the_command_line_not_the_file():
    message = refused(TINY, ["model.n_layer=0"])
    assert message == "model.n_layer must be >= 1, got 0 (command line: model.n_layer=0)"


def test_an_override_of_the_wrong_type_is_quoted():
    assert refused(TINY, ["seed=abc"]) == "seed must be an integer, got 'abc' (command line: seed=abc)"
    assert refused(TINY, ["out_dir=  "]) == (
        "out_dir is empty; give a folder name, or leave it unset for runs/<config file name> "
        "(command line: 'out_dir=  ')")


def test_a_bad_value_in_the_file_is_still_blamed_on_the_file(tmp_path):
    path = write_yaml(tmp_path, "model:\n  n_layer: 0\n")
    assert refused(path, ["seed=3"]) == f"model.n_layer must be >= 1, got 0 (in {shown(path)})"


@pytest.mark.parametrize(
    ("overrides", "origin"),
    [
        (["model.n_embd=30"], "(command line: model.n_embd=30; model.n_head in {tiny})"),
        (["model.n_head=5"], "(command line: model.n_head=5; model.n_embd in {tiny})"),
        (["model.n_embd=30", "model.n_head=4"], "(command line: model.n_embd=30 model.n_head=4)"),
    ],
)
def test_a_check_of_two_keys_names_where_each_came_from(overrides, origin):
    message = refused(TINY, overrides)
    assert message.startswith("model.n_embd must be divisible by model.n_head")
    assert message.endswith(origin.format(tiny=TINY))


def test_a_key_left_at_its_default_is_named_as_the_default(tmp_path):
    message = refused(write_yaml(tmp_path, "seed: 1\n"), ["train.min_lr=0.5"])
    assert message.endswith("(command line: train.min_lr=0.5; default train.learning_rate)")


def test_a_refused_value_that_reads_like_a_key_names_no_key():
    # 'seed' here is the value the message quotes, not the top-level key seed (which the file sets)
    message = refused(TINY, ["train.device=seed"])
    assert message.endswith("got 'seed' (command line: train.device=seed)")


def test_a_saved_config_with_a_bad_override_names_both():
    base = to_dict(load_config(str(TINY), []))
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.n_embd=30"], base=base)
    assert str(info.value).endswith("(command line: model.n_embd=30; model.n_head as configured)")


# ------------------------------------------------------------------------------------- bounded reading


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_is_refused_without_reading_it():
    started = time.monotonic()
    assert "'/dev/zero' is a character device, not a file" in refused("/dev/zero")
    assert time.monotonic() - started < 1


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_pipe_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)
    assert "is a pipe" in refused(fifo)


@pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="needs Unix sockets")
def test_a_socket_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a socket's path must be short
    with socket.socket(socket.AF_UNIX) as server:
        server.bind("s.yaml")
        assert "'s.yaml' is a socket, not a file" in refused("s.yaml")


def test_a_file_over_the_limit_is_refused_before_it_is_parsed(tmp_path):
    path = write_yaml(tmp_path, "seed: 1\n" + "#" * MAX_CONFIG_BYTES + "\n")
    assert f"the limit is {MAX_CONFIG_BYTES:,}: give a smaller file" in refused(path)  # what is wrong and what to do
    write_yaml(tmp_path, "seed: 1\n" + "#" * (MAX_CONFIG_BYTES - 20) + "\n")  # just under: read as usual
    assert load_config(str(path), []).seed == 1


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="needs POSIX user ids (os.getuid)")
def test_a_file_that_must_be_ones_own_is_refused_when_another_user_owns_it(tmp_path, monkeypatch):
    path = tmp_path / "step.pt2"
    path.write_bytes(b"code")
    assert read_user_file(path, "compiled step", 10, own=True) == b"code"
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    assert read_user_file(path, "compiled step", 10) == b"code"  # only asked of files whose code is run
    with pytest.raises(ValueError, match="^compiled step: '.*step.pt2' belongs to another user; remove it"):
        read_user_file(path, "compiled step", 10, own=True)


def test_a_file_that_is_not_utf8_is_refused_naming_the_byte(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"seed: 1\nout_dir: caf\xe9\n")
    assert "not UTF-8 text (byte 20 is 0xe9)" in refused(path)


# ------------------------------------------------------------------------------------- bounded messages


def laughs(levels: int = 9, width: int = 9) -> str:
    """A list of nested YAML aliases, each level `width` copies of the one before: width**levels strings from a few
    hundred bytes (the "billion laughs" shape)."""
    names = [chr(ord("a") + i) for i in range(levels)]
    rows = [f"&{names[0]} [{', '.join(['lol'] * width)}]"]
    rows += [f"&{name} [{', '.join([f'*{prev}'] * width)}]" for prev, name in itertools.pairwise(names)]
    return "[" + ", ".join(rows) + "]"


@pytest.mark.parametrize(
    "text",
    [
        "seed: {laughs}\n",  # an integer field
        "model:\n  attention: {laughs}\n",  # a string field
        "data:\n  path: {laughs}\n",  # a string-or-null field
        "train: {{max_iters: 5}}\nzzz: {laughs}\n",  # an unknown key whose value is huge
    ],
)
def test_a_few_hundred_bytes_of_nested_aliases_give_a_short_line_at_once(here, text):
    path = write_yaml(here, text.format(laughs=laughs()))
    assert path.stat().st_size < 1000
    started = time.monotonic()
    message = refused(path.name)
    assert time.monotonic() - started < 0.5
    assert len(message) < SHORT


def test_a_huge_value_quoted_by_a_configs_own_check_is_cut_short(here):
    path = write_yaml(here, f"train:\n  device: {'x' * 10_000}\n")
    message = refused(path.name)
    assert message.startswith("train.device must be one of") and len(message) < SHORT
    assert len(refused(TINY, [f"train.device={'y' * 10_000}"])) < SHORT


@pytest.mark.parametrize("key", ["bad\nkey", "k" * 10_000, "\x1b[2Jclear"])
def test_an_unknown_key_is_echoed_escaped_and_short(here, key):
    path = write_yaml(here, f"? {key!r}\n: 1\n".replace("'", '"'))  # ? for a key over 1024 characters
    assert load_yaml(path) == {key: 1}  # the premise: YAML reads the key as written
    for message in (refused(path.name), refused(TINY, [f"{key}=1"]), refused(TINY, [key])):
        assert len(message) < SHORT and "\x1b" not in message
    assert "unknown config key 'bad\\nkey'" in refused(TINY, ["bad\nkey=1"])


def test_a_huge_override_value_is_quoted_short():
    message = refused(TINY, [f"seed={'9x' * 10_000}"])
    assert message.startswith("seed must be an integer, got '9x9x") and len(message) < SHORT


def test_a_config_path_with_a_newline_stays_on_one_line(here):
    # a relative path: the message quotes about 80 characters of it, and a long temp folder would push the name out
    path = write_yaml(here, "model:\n  n_layer: 0\n", name="two\nlines.yaml")
    assert "two\\nlines.yaml" in refused(path.name)  # refused() checks it is one line


def test_a_long_path_is_quoted_by_its_start_and_its_end_so_the_file_stays_named(tmp_path):
    deep = tmp_path.joinpath(*[f"folder-{i:02d}" for i in range(12)])  # over 130 characters, in any temp folder
    path = deep / "my-run.yaml"
    message = refused(str(path))
    assert message.startswith("config file: no such file '")
    quoted = message.split("'")[1]
    assert "..." in quoted and len(quoted) == QUOTE_LIMIT
    assert str(path).startswith(quoted.split("...")[0]) and quoted.endswith("folder-11/my-run.yaml")
    assert shown("x" * 5 + "/name.txt", limit=12) == "xxxx...e.txt"  # 4 of the start, 3 dots, 5 of the end
    assert shown("y" * 12, limit=12) == "y" * 12  # within the limit, whole


def test_a_long_alias_name_in_a_yaml_error_is_cut_short(here):
    message = refused(write_yaml(here, f"seed: *{'a' * 10_000}\n").name)
    assert "not valid YAML" in message and len(message) < SHORT


def test_deep_nesting_is_refused_in_one_line(tmp_path):
    assert "nested too deeply" in refused(write_yaml(tmp_path, "seed: " + "[" * 5000 + "]" * 5000 + "\n"))


def test_a_date_where_a_text_goes_is_told_to_be_quoted(tmp_path):
    # "out_dir must be a string or null, got datetime.date(2024, 1, 1)": no word of why, or of the way out
    message = refused(write_yaml(tmp_path, "out_dir: 2024-01-01\n"))
    assert "YAML reads an unquoted date as one: put it in quotes" in message
    assert "quotes" not in refused(write_yaml(tmp_path, "seed: 2024-01-01\n"))  # a number goes there: no quotes


def test_a_long_chain_of_merges_is_refused_in_one_line(tmp_path):
    # each mapping merges the one before: 24 KB, under the size limit, and the check for keys merged twice recursed
    # down the chain to a RecursionError traceback
    chain = ["a0: &a0 {k: 1}"] + [f"a{i}: &a{i} {{<<: *a{i - 1}}}" for i in range(1, 1000)]
    path = write_yaml(tmp_path, "\n".join(chain) + "\n")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 300)  # where a pytest-xdist worker allows more, past it all the same
    try:
        message = refused(path)
    finally:
        sys.setrecursionlimit(limit)
    assert "nested too deeply" in message


def test_a_tilde_on_the_command_line_is_the_home_folder_and_null_still_unsets():
    # out_dir=~ was YAML's null, so the run went to the default runs/tiny, though "~ is your home" (README)
    assert load_config(TINY, ["out_dir=~"]).out_dir == os.path.expanduser("~")
    assert load_config(TINY, ["data.path=x.txt", "data.path=null"]).data.path is None
    assert load_config(TINY, ["data.path=x.txt", "data.path=none"]).data.path is None


def test_an_out_dir_in_the_home_folder_of_an_unknown_user_is_refused_as_data_path_is():
    # out_dir=~nouser/x made a folder named '~nouser' in the current one, where data.path refused the same value;
    # refused as every bad setting of the config is (a ConfigError), whoever reads the config
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["out_dir=~no-such-user-here/x"])
    assert str(e.value) == ("out_dir: '~no-such-user-here/x' starts with the home folder of 'no-such-user-here', a "
                            "user this machine does not know; give the folder's full path")


@pytest.mark.parametrize("key", ["data.path", "data.cache_dir", "out_dir"])
@pytest.mark.parametrize("word", ["none", "NULL"])
def test_none_for_a_path_is_refused_where_a_file_of_that_name_is_here(tmp_path, monkeypatch, key, word):
    # data.path=none trained on the default corpus while a file named none lay in the folder it ran from
    def value(overrides: list[str]) -> str | None:
        cfg = load_config(TINY, overrides)
        return getattr(cfg.data if key.startswith("data.") else cfg, key.rsplit(".", 1)[-1])

    monkeypatch.chdir(tmp_path)
    assert value([f"{key}={word}"]) == value([])  # nothing of that name here: the word unsets the key
    (tmp_path / word).write_text("my own text\n")
    message = refused(TINY, [f"{key}={word}"])
    assert f"write {key}=./{word} for it" in message and "is also a file here" in message
    assert value([f"{key}=./{word}"]) == f"./{word}"  # what the line offers
    (tmp_path / word).unlink()
    (tmp_path / word).mkdir()
    assert "is also a folder here" in refused(TINY, [f"{key}={word}"])
    # A key that names no file keeps the word's meaning
    assert load_config(TINY, ["data.path=x.txt", f"data.dataset={word}"]).data.dataset is None


def test_a_path_written_as_a_number_in_the_file_is_the_text_as_written(tmp_path):
    # YAML reads unquoted digits as a number: out_dir: 001 trained into the folder '1', and 0123 (octal) into '83'.
    # The keys that are text keep what is written; the numbers stay numbers.
    text = "out_dir: 001\ndata:\n  path: 0123\n  cache_dir: 1_000\ntrain:\n  max_iters: 5_000\n  eval_interval: 0x10\n"
    cfg = load_config(str(write_yaml(tmp_path, text)), [])
    assert (cfg.out_dir, cfg.data.path, cfg.data.cache_dir) == ("001", "0123", "1_000")
    assert (cfg.train.max_iters, cfg.train.eval_interval) == (5000, 16)
    assert load_config(str(write_yaml(tmp_path, "out_dir: '001'\n", "quoted.yaml")), []).out_dir == "001"


@pytest.mark.parametrize("word", ["off", "yes", "True"])
def test_a_path_written_as_a_yaml_bool_in_the_file_is_the_text_as_written(tmp_path, word):
    # YAML 1.1 reads an unquoted off as false: `out_dir: off` was refused as "must be a string or null, got False",
    # where out_dir=off on the command line is the folder 'off'
    cfg = load_config(str(write_yaml(tmp_path, f"out_dir: {word}\ndata:\n  cache_dir: {word}\n")), [])
    assert (cfg.out_dir, cfg.data.cache_dir) == (word, word)
    assert load_config(TINY, [f"out_dir={word}"]).out_dir == word
    assert "data.dataset must be one of" in refused(write_yaml(tmp_path, f"data:\n  dataset: {word}\n"))
    assert load_config(str(write_yaml(tmp_path, "out_dir: ~\n", "null.yaml")), []).out_dir == str(Path("runs/null"))


@pytest.mark.parametrize("key", ["train.learning_rate", "train.beta1", "model.dropout"])
def test_an_integer_past_floats_range_for_a_number_is_refused_in_one_line(tmp_path, key):
    # YAML reads 400 digits as an int, which float() refuses with an OverflowError: that was a traceback
    section, name = key.split(".")
    message = refused(write_yaml(tmp_path, f"{section}:\n  {name}: 1{'0' * 400}\n"))
    assert message.startswith(f"{key} must be") and "inf" in message and len(message) < SHORT
    assert refused(TINY, [f"{key}=1{'0' * 400}"]).startswith(f"{key} must be")


@pytest.mark.parametrize("key", ["train.learning_rate", "train.grad_clip", "train.ema_decay", "train.beta1",
                                 "model.dropout", "data.val_fraction"])
# 1__0.0e-400 and 1_.0e-400: YAML's underscores, which Python's float refuses and the command line reads apart
@pytest.mark.parametrize("word", ["1e-400", "-1e-400", "1.0e-400", "2.5E-999", "1__0.0e-400", "-1_.0e-400"])
def test_a_real_too_small_for_a_float_is_refused_not_read_as_zero(tmp_path, key, word):
    # float() reads 1e-400 as 0 without a word, in a file (YAML's 1.0e-400 is the float 0.0) and on the command line:
    # train.grad_clip=1e-400 was no clipping at all, its 0, where 1e-300 clips the gradient to nothing;
    # train.ema_decay=1e-400 kept no average, and train.beta1=-1e-400 was taken as 0 where -1e-300 is refused
    section, name = key.split(".")
    for message in (refused(TINY, [f"{key}={word}"]), refused(write_yaml(tmp_path, f"{section}:\n  {name}: {word}\n"))):
        assert message.startswith(f"{key}: {word} is too near 0 for a float (the least above 0 is about 5e-324), "
                                  f"so it would be read as 0; write 0 if 0 is meant"), message
        assert len(message) < SHORT


@pytest.mark.parametrize(("word", "value"), [("0", 0.0), ("-0", 0.0), ("0.0", 0.0), ("0e-400", 0.0), ("-0.0e+5", 0.0),
                                             ("0x0", 0.0), ("1e-300", 1e-300), ("2.5e-324", 5e-324), ("2.4e-324", None),
                                             ("1.0e-324", None)])
def test_zero_and_the_smallest_floats_are_taken_and_what_rounds_to_zero_is_not(tmp_path, word, value):
    # float() rounds what is below half the least float above 0 (about 2.47e-324) to 0, and the rest up to it
    from_file = write_yaml(tmp_path, f"train:\n  grad_clip: {word}\n")
    if value is None:
        assert "is too near 0 for a float" in refused(TINY, [f"train.grad_clip={word}"])
        assert "is too near 0 for a float" in refused(from_file)
        return
    from_line = load_config(TINY, [f"train.grad_clip={word}"])
    assert from_line.train.grad_clip == load_config(str(from_file), []).train.grad_clip == value


@pytest.mark.parametrize("key", ["train.max_iters", "train.warmup_iters", "train.lr_decay_iters", "train.eval_iters",
                                 "model.block_size", "model.n_embd"])
def test_a_count_past_64_bits_is_refused_in_one_line(tmp_path, key):
    # YAML reads 400 digits as an int: max_iters, warmup_iters and lr_decay_iters of that size were an OverflowError
    # from TensorBoard's hyperparameters after the run had written config.yaml, and a block_size a line of 400 digits
    section, name = key.split(".")
    huge = f"1{'0' * 400}"
    message = refused(write_yaml(tmp_path, f"{section}:\n  {name}: {huge}\n"))
    assert message.startswith(f"{key} must be at most 2**63 - 1, got 1") and len(message) < SHORT
    assert refused(TINY, [f"{key}={huge}"]).startswith(f"{key} must be at most 2**63 - 1")
    assert refused(TINY, [f"{key}=9223372036854775808"]).startswith(f"{key} must be at most 2**63 - 1")
    saved = to_dict(load_config(TINY, []))
    saved[section][name] = int(huge)
    with pytest.raises(ConfigError, match=f"{key} must be at most"):
        load_config(None, [], base=saved, origin="a checkpoint")
    if section == "train":  # the largest is taken
        assert getattr(load_config(TINY, [f"{key}=9223372036854775807"]).train, name) == 2**63 - 1


@pytest.mark.parametrize(("text", "read"), [("train:\n  batch_size: 010\n", "an octal number, 8"),
                                            ("seed: 0123\n", "an octal number, 83"),
                                            ("train:\n  max_iters: -0_10\n", "an octal number, -8"),
                                            ("train:\n  batch_size: 1:30\n", "a base-60 number, 90"),
                                            ("train:\n  learning_rate: 1:30.5\n", "a base-60 number, 90.5")])
def test_a_number_yaml_reads_otherwise_than_it_looks_is_refused(tmp_path, text, read):
    # YAML 1.1 reads a leading 0 as octal and a ':' as base 60: batch_size: 010 trained with 8 sequences, where
    # train.batch_size=010 on the command line is 10
    message = refused(write_yaml(tmp_path, text))
    assert f"which YAML reads as {read}; write the number you mean in decimal" in message


def test_numbers_that_read_as_they_look_are_taken(tmp_path):
    text = "seed: 07\ntrain:\n  batch_size: 08\n  max_iters: '010'\n  eval_interval: 0x10\n  eval_iters: 00\n"
    with pytest.raises(ConfigError, match="train.eval_iters must be >= 1, got 0"):  # 00 is 0 either way
        load_config(str(write_yaml(tmp_path, text)), [])
    cfg = load_config(str(write_yaml(tmp_path, text.replace("00", "0_1"))), [])
    assert (cfg.seed, cfg.train.batch_size, cfg.train.max_iters, cfg.train.eval_interval) == (7, 8, 10, 16)
    assert cfg.train.eval_iters == 1


@pytest.mark.parametrize(("key", "word", "value"), [("train.eval_interval", "0x10", 16),
                                                    ("train.eval_interval", "0b1_0", 2),
                                                    ("train.eval_interval", "0xE", 14),  # not 0 x 10**E
                                                    ("train.eval_interval", "1__0", 10),
                                                    ("train.eval_interval", "10_", 10),
                                                    ("seed", "-0x10", -16),
                                                    ("train.learning_rate", "0x1", 1.0),
                                                    # a float's underscores as YAML reads them: Python's float
                                                    # takes one between two digits alone
                                                    ("train.learning_rate", "1__0.5", 10.5),
                                                    ("train.learning_rate", "1_.5e-3", 1.5e-3),
                                                    ("train.learning_rate", ".5_", 0.5),
                                                    ("train.decay_lr", "+0", False),
                                                    ("train.decay_lr", "0x1", True),
                                                    ("train.compile", "01", "true"),
                                                    ("model.bias", "+1", True)])
def test_a_number_means_the_same_in_the_file_and_on_the_command_line(tmp_path, key, word, value):
    # YAML reads an unquoted 0x10 as 16 and +1 as 1 (true, for a switch); the same words on the command line were
    # refused as no integer, no number, not true/false
    *section, name = key.split(".")
    text = f"{section[0]}:\n  {name}: {word}\n" if section else f"{name}: {word}\n"
    from_file = load_config(str(write_yaml(tmp_path, text)), [])
    from_line = load_config(TINY, [f"{key}={word}"])
    for cfg in (from_file, from_line):
        assert getattr(getattr(cfg, section[0]) if section else cfg, name) == value


def test_yamls_infinity_is_named_so_on_the_command_line_too(tmp_path):
    # .inf was "must be a number" on the command line, where the file's .inf is refused for not being finite
    for word in (".inf", "-.Inf", ".NaN"):
        assert "must be a finite number >= 0, got" in refused(TINY, [f"train.learning_rate={word}"])
        assert "must be a finite number >= 0, got" in refused(
            write_yaml(tmp_path, f"train:\n  learning_rate: {word}\n"))
    assert "must be an integer" in refused(TINY, ["train.eval_interval=0x_"])
    # past Python's 4,300 digits of integer text: a ValueError traceback once underscores were read as YAML's
    assert "seed must be an integer, got '99999" in refused(TINY, [f"seed={'9' * 5000}"])
    assert "seed must be an integer, got '1_999" in refused(TINY, [f"seed=1_{'9' * 5000}"])
    assert "must be true/false" in refused(TINY, ["train.decay_lr=0x2"])


def _resolve_as_in_python_313(self: Path, strict: bool = False) -> Path:
    """Path.resolve as Python 3.13 answers for a loop of links: strict, ELOOP; otherwise the path given back whole."""
    if strict:
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(self))
    return Path(os.path.abspath(self))


def _resolve_as_in_python_311(self: Path, strict: bool = False) -> Path:
    raise RuntimeError(f"Symlink loop from '{self}'")


def test_a_loop_of_links_is_found_on_every_python(tmp_path, monkeypatch):
    # Python 3.13 resolves a loop of links to the loop's own name (strict=False), where 3.11 and 3.12 raise
    # RuntimeError: bench.py --json and sample.py --attention-map took such a name for a new file there
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    for path in (loop, loop / "out.png"):
        with pytest.raises(OSError) as seen:
            resolved(path)
        assert seen.value.errno == errno.ELOOP
    for emulated in (_resolve_as_in_python_313, _resolve_as_in_python_311):
        with monkeypatch.context() as m:
            m.setattr(Path, "resolve", emulated)
            with pytest.raises(OSError) as seen:
                resolved(loop)
            assert seen.value.errno == errno.ELOOP


def test_what_is_not_a_loop_resolves_as_path_resolve_does(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "a.png").write_bytes(b"")
    (tmp_path / "link").symlink_to("real")
    (tmp_path / "dangling").symlink_to("nowhere/b.png")
    for name in ("link/a.png", "link/new.png", "new.png", "missing/new.png", "dangling", "real/a.png/x"):
        assert resolved(tmp_path / name) == (tmp_path / name).resolve(), name
    assert resolved(tmp_path / "link" / "a.png") == tmp_path.resolve() / "real" / "a.png"



@pytest.mark.parametrize(("key", "kept"), [("train.device", "must be one of auto, cpu, cuda, cuda:N, mps; got "),
                                           ("data.dataset", "shakespeare_char (or unset with data.path given), got")])
@pytest.mark.parametrize("value", ["x" * 300, "it's" + "x" * 300])  # repr quotes the second with "
def test_a_long_value_is_cut_not_the_values_that_would_do(key, kept, value):
    # the message was cut as a whole in its middle: the list of values that would do lost its end
    message = refused(TINY, [f"{key}={value}"])
    assert kept in message and "xxxxxxxxxxxxxxxxxxxx" + ("'" if "'" not in value else '"') in message
    assert "..." in message and len(message) < 400
