"""Property-based tests (hypothesis) of what reads input from people: the tokenizer over any Unicode text, and the
config reader over any YAML text, any plain data and any override string. Each gives a result or one clear line,
never a traceback."""

from __future__ import annotations

import functools
from pathlib import Path
from unittest import mock

import pytest
import yaml
from conftest import ROOT
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import training.config
from configs import ConfigError, build, load_yaml, to_dict, valid_keys
from data import CharTokenizer
from training.config import RunConfig, load_config

TINY = str(ROOT / "configs" / "tiny.yaml")
KEYS = valid_keys(RunConfig)
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Every code point a Python str can hold, lone surrogates included (they cannot come from a UTF-8 file, but can from
# a string built in code, and the tokenizer takes any str).
ANY_CHAR = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
ANY_TEXT = st.text(ANY_CHAR, max_size=200)


def one_clear_line(e: Exception) -> str:
    message = str(e)
    assert message and message == message.strip() and "\n" not in message and "\r" not in message, repr(message)
    assert "Traceback" not in message
    return message


# ------------------------------------------------------------------------------------------ tokenizer


@FAST
@given(ANY_TEXT)
def test_any_text_round_trips_through_its_own_vocabulary(text):
    tok = CharTokenizer.from_text(text)
    assert tok.chars == sorted(set(text))
    ids = tok.encode(text)
    assert len(ids) == len(text) and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.encode_tensor(text).tolist() == ids
    assert tok.decode(ids) == text
    assert CharTokenizer(tok.chars) == tok  # the vocabulary a checkpoint stores rebuilds the same tokenizer


@FAST
@given(vocab_text=ANY_TEXT, text=ANY_TEXT)
@example(vocab_text="abc", text="\U0010ffff")  # above every code point of the vocabulary
@example(vocab_text="xyz", text="\x00")  # below every one
@example(vocab_text="", text="a")  # an empty vocabulary knows nothing
def test_text_outside_the_vocabulary_is_refused_naming_what_is_missing(vocab_text, text):
    tok = CharTokenizer.from_text(vocab_text)
    missing = sorted(set(text) - set(vocab_text))
    assert tok.unknown(text) == missing
    if not missing:
        assert tok.decode(tok.encode(text)) == text
        return
    for encode in (tok.encode, tok.encode_tensor):
        with pytest.raises(ValueError) as info:
            encode(text)
        message = one_clear_line(info.value)
        assert f"{len(missing)} character(s) not in the vocabulary" in message
        for c in missing[:20]:
            assert repr(c) in message


@FAST
@given(vocab_text=ANY_TEXT, ids=st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=50))
def test_decoding_any_ids_gives_text_or_names_the_id_outside_the_vocabulary(vocab_text, ids):
    tok = CharTokenizer.from_text(vocab_text)
    if all(0 <= i < tok.vocab_size for i in ids):
        assert tok.decode(ids) == "".join(tok.chars[i] for i in ids)
        return
    with pytest.raises(ValueError) as info:
        tok.decode(ids)
    bad = next(i for i in ids if not 0 <= i < tok.vocab_size)
    assert f"id {bad} is outside the vocabulary" in one_clear_line(info.value)


@FAST
@given(st.lists(st.text(ANY_CHAR, max_size=2), max_size=8))
def test_a_vocabulary_list_is_taken_only_sorted_unique_and_single_characters(chars):
    valid = all(len(c) == 1 for c in chars) and chars == sorted(set(chars))
    if valid:
        assert CharTokenizer(chars).chars == chars
        return
    with pytest.raises(ValueError) as info:
        CharTokenizer(chars)
    one_clear_line(info.value)


# ------------------------------------------------------------------------------------------ config reader


def value_text() -> st.SearchStrategy[str]:
    """What people type after '=': numbers in every spelling, YAML-ish words, and anything at all."""
    numbers = st.one_of(st.integers(), st.floats(allow_nan=True, allow_infinity=True)).map(str)
    words = st.sampled_from(["", " ", "null", "None", "~", "true", "False", "yes", "off", "1e3", "1_000", "0x10",
                             "3e-4", "nan", "-inf", "1e400", "9" * 5000, "[1, 2]", "{a: 1}", "'quoted'", "a\nb"])
    return st.one_of(numbers, words, ANY_TEXT)


OVERRIDES = st.one_of(
    st.builds(lambda key, value: f"{key}={value}", st.sampled_from(KEYS), value_text()),  # a real key
    st.builds(lambda key, value: f"{key}={value}", ANY_TEXT, value_text()),  # any key at all
    ANY_TEXT,  # anything, '=' or not
)


_read = functools.cache(training.config.load_yaml)


def read_once(path: str, **kwargs: frozenset[str]) -> dict:
    """load_config's load_yaml, reading each file once: every example reads TINY, and its two passes of PyYAML's
    parser were half of each example's time (this test: 2.8 s of CPU, 1.4 s so, 2026-12-05, 2-core AMD EPYC (Zen 3,
    AVX2)). Each call gets its own copy of the sections, as from a reading of its own."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in _read(path, **kwargs).items()}


@FAST
@given(st.lists(OVERRIDES, max_size=3))
@example(["train.max_iters=1e400"])
@example(["model.n_embd=30", "model.n_head=4"])
@example(["bad\nkey=1"])  # a newline in what is echoed back must not break the line
@example(["seed=99999999999999999999999"])
@example(["data.path=null"])  # once a traceback: unsetting the path also dropped the config's dataset
@example(["out_dir=~tinychar-no-such-user/run"])  # was a DataError, not the ConfigError every bad setting gives
def test_any_override_gives_a_config_or_one_clear_line(overrides):
    try:
        with mock.patch.object(training.config, "load_yaml", read_once):
            cfg = load_config(TINY, overrides)
    except ConfigError as e:
        one_clear_line(e)
        return
    assert isinstance(cfg, RunConfig)
    # what was accepted is what a resumed run or config.yaml will hold: it survives a round trip
    assert load_config(None, [], base=to_dict(cfg)) == cfg


@pytest.fixture(scope="module")
def yaml_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("yaml") / "run.yaml"


@FAST
@given(text=st.one_of(ANY_TEXT, st.text(st.sampled_from("abc:-[]{}!&*?|>'\"%@`#,.0123456789 \n\t\\"), max_size=80)))
@example(text="seed: 2024-13-45\n")  # a date PyYAML parses but Python cannot build
@example(text="seed: 2001-02-03 25:61:00\n")
# Deeper than the parser's recursion, here too, where hypothesis allows 2,000 frames more than the test had: 800 levels
# are read as unclosed YAML, 1,000 are too deeply nested. PyYAML's time grows with the square of the depth: 1,200
# levels take 0.6 s of CPU, 2,000 took 2.3 s (2026-12-05, 2-core AMD EPYC (Zen 3, AVX2)); tests/test_configs_input.py
# refuses 5,000 levels under the default limit.
@example(text="[" * 1200)
@example(text="!!python/object/apply:os.system ['echo hi']\n")
@example(text="train: !!float 'abc'\n")
@example(text="a: &x [*x]\n")
def test_any_yaml_text_gives_a_config_or_one_clear_line(yaml_file, text):
    yaml_file.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        mapping = load_yaml(yaml_file)
        cfg = build(RunConfig, mapping, f" (in {yaml_file})")
    except ConfigError as e:
        one_clear_line(e)
        return
    assert isinstance(cfg, RunConfig)


PLAIN = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), ANY_TEXT),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.one_of(st.sampled_from(["data", "model", "train", "seed",
                                                                          "out_dir", "n_head", "dropout",
                                                                          "max_iters", "path"]), ANY_TEXT),
                                               children, max_size=4)),
    max_leaves=12,
)


@FAST
@given(PLAIN)
@example({"model": {"n_embd": 30, "n_head": 4}})
@example({"train": {"batch_size": True}})
@example({"seed": 2.5})
def test_any_plain_data_builds_a_config_or_one_clear_line(data):
    try:
        cfg = build(RunConfig, data)
    except ConfigError as e:
        one_clear_line(e)
        return
    assert isinstance(cfg, RunConfig)
    # and the same data through a YAML file, as a person would write it, gives the same config
    assert build(RunConfig, yaml.safe_load(yaml.safe_dump(data))) == cfg
