"""configs/ (the loader) and training/config.py's load_config: every shipped YAML loads, misspelt keys name the
nearest valid one, bad values are refused in one line, YAML is read as plain data only, and command-line overrides are
typed by the field they set."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from configs import ConfigError, apply_overrides, build, coerce, flatten, load_yaml, to_dict, valid_keys
from configs.names import option_as_setting
from configs.userinput import shown
from model import GPT
from training.config import RunConfig, load_config

CONFIG_FILES = sorted((ROOT / "configs").glob("*.yaml"))
TINY = ROOT / "configs" / "tiny.yaml"


def write_yaml(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def refused(config: Path | str | None, overrides: list[str] = ()) -> str:
    """The one-line message with which load_config refuses this config."""
    with pytest.raises(ConfigError) as info:
        load_config(None if config is None else str(config), list(overrides))
    message = str(info.value)
    assert "\n" not in message and message.strip() == message and message
    return message


# ------------------------------------------------------------------------------------------- shipped files


def test_the_shipped_configs_are_there():
    # guards the parametrized test below, which would otherwise pass by running zero cases
    assert {p.name for p in CONFIG_FILES} >= {"tiny.yaml", "shakespeare_char.yaml", "shakespeare_char_cpu.yaml"}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_builds_its_model(path: Path):
    cfg = load_config(str(path), [])
    assert isinstance(cfg, RunConfig)
    assert cfg.out_dir == str(Path("runs") / path.stem)
    # every key the file sets reaches the config: nothing is silently dropped or altered
    built = flatten(to_dict(cfg))
    for key, value in flatten(load_yaml(path)).items():
        if key == "train.compile" and isinstance(value, bool):  # YAML's true/false, kept as "true"/"false"
            value = str(value).lower()
        assert built[key] == (float(value) if isinstance(built[key], float) else value), key
    model = GPT(replace(cfg.model, vocab_size=65))
    assert model.config.vocab_size == 65 and model.config.block_size == cfg.model.block_size
    assert model.num_params() > 0


# ------------------------------------------------------------------------------------------- misspelt keys


@pytest.mark.parametrize(
    ("text", "suggestion"),
    [
        ("train:\n  learnin_rate: 0.01\n", "train.learning_rate"),
        ("learning_rate: 0.01\n", "train.learning_rate"),  # a train key written at the top level
        ("model:\n  n_emb: 32\n", "model.n_embd"),
        ("sed: 3\n", "seed"),
        ("trian:\n  max_iters: 5\n", "train"),  # a misspelt section
        ("modle:\n  n_layer: 2\n", "model"),
        ("TRAIN:\n  max_iters: 5\n", "train"),  # in other capitals: no suggestion at all, difflib minds case
        ("SEED: 3\n", "seed"),
    ],
)
def test_a_misspelt_key_in_the_file_names_the_nearest_valid_key(tmp_path, text, suggestion):
    path = write_yaml(tmp_path, text)
    message = refused(path)
    assert f"did you mean '{suggestion}'?" in message
    assert shown(path) in message


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("train.learning_rat=1", "train.learning_rate"),
        ("learning_rate=1", "train.learning_rate"),
        ("trian.max_iters=5", "train.max_iters"),
        ("model.nlayer=2", "model.n_layer"),
        # other trainers' names, which spelling alone took for another setting (train.min_lr, train.threads, ...)
        ("train.lr=0.01", "train.learning_rate"),
        ("train.steps=100", "train.max_iters"),
        ("data.file=a.txt", "data.path"),
        ("model.d_model=64", "model.n_embd"),
        ("model.num_heads=4", "model.n_head"),
        ("model.context_length=64", "model.block_size"),
        ("train.adam.beta1=0.9", "train.beta1"),
        ("TRAIN.MAX_ITERS=5", "train.max_iters"),
        ("DATA.PATH=a.txt", "data.path"),
    ],
)
def test_a_misspelt_override_names_the_nearest_valid_key(override, suggestion):
    message = refused(TINY, [override])
    assert f"did you mean '{suggestion}'?" in message
    assert "command line" in message


def test_a_dotted_key_in_a_file_says_to_nest_it(tmp_path):
    # it was "unknown config key 'train.batch_size'; did you mean 'train.batch_size'?"
    message = refused(write_yaml(tmp_path, "train.batch_size: 4\n"))
    assert message.endswith("; in a file, nest it: 'batch_size:' indented under 'train:' (dotted keys are for the "
                            "command line)") and "did you mean" not in message


def test_an_integer_too_long_for_python_is_one_line_without_pythons_advice(tmp_path):
    message = refused(write_yaml(tmp_path, "seed: " + "9" * 5000 + "\n"))
    assert "an integer too long for Python to read" in message and "give a smaller number" in message
    assert "set_int_max_str_digits" not in message and len(message) < 300


def test_an_unguessable_key_points_at_help(tmp_path):
    message = refused(write_yaml(tmp_path, "zzzzqqqq: 1\n"))
    assert "zzzzqqqq" in message and "--help" in message
    # the section's name in common is no likeness: train.adam was taken for train.threads, data.x for data
    for text, key in (("train:\n  adam:\n    beta1: 0.9\n", "train.adam"), ("data:\n  x: 1\n", "data.x")):
        message = refused(write_yaml(tmp_path, text))
        assert f"unknown config key '{key}'" in message and "did you mean" not in message and "--help" in message


def test_an_override_must_be_key_equals_value():
    assert "KEY=VALUE" in refused(TINY, ["train.max_iters"])


# --------------------------------------------------------------------------------------- types and values


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("model:\n  n_layer: four\n", "model.n_layer must be an integer"),
        ("train:\n  batch_size: 1.5\n", "train.batch_size must be an integer"),
        ("model:\n  bias: maybe\n", "model.bias must be true/false"),
        ("train:\n  learning_rate: fast\n", "train.learning_rate must be a number"),
        ("model:\n  block_size: true\n", "model.block_size must be an integer"),
        ("train: 5\n", "section 'train'"),
        ("- a\n- b\n", "mapping"),
        ("model: [1, 2\n", "not valid YAML (line"),
    ],
)
def test_a_wrong_type_in_the_file_is_refused_in_one_line(tmp_path, text, fragment):
    assert fragment in refused(write_yaml(tmp_path, text))



def test_one_and_zero_are_true_and_false_in_a_file_as_on_the_command_line(tmp_path):
    # train.compile=1 on the command line compiled, where compile: 1 in a file was refused
    path = write_yaml(tmp_path, "model:\n  bias: 0\ntrain:\n  compile: 1\n  tensorboard: 0\n")
    for cfg in (load_config(path, []), load_config(TINY, ["model.bias=0", "train.compile=1", "train.tensorboard=0"])):
        assert (cfg.model.bias, cfg.train.compile, cfg.train.tensorboard) == (False, "true", False)
    assert "model.bias must be true/false, got 2" in refused(write_yaml(tmp_path, "model:\n  bias: 2\n"))

@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["train.max_iters=1.5"], "train.max_iters must be an integer"),
        (["model.bias=maybe"], "model.bias must be true/false"),
        (["train.learning_rate=fast"], "train.learning_rate must be a number"),
        (["seed="], "seed must be an integer"),
        (["model.n_embd=30", "model.n_head=4"], "model.n_embd must be divisible by model.n_head, got 30 and 4"),
        (["model.block_size=0"], "model.block_size must be >= 1"),
        (["model.block_size=-3"], "model.block_size must be >= 1"),
        (["data.val_fraction=0"], "data.val_fraction must be between 0 and 1"),
        (["data.val_fraction=1"], "data.val_fraction must be between 0 and 1"),
        (["data.val_fraction=1.5"], "data.val_fraction must be between 0 and 1"),
        (["data.val_fraction=nan"], "data.val_fraction must be between 0 and 1"),
        # a subnormal: 0 to training's flushed arithmetic, where the split refused it in a ValueError traceback
        (["data.val_fraction=1e-320"], "data.val_fraction must be at least 2.225e-308, the smallest normal float, got "
                                       "1e-320"),
        (["train.learning_rate=-0.001"], "train.learning_rate must be a finite number >= 0"),
        (["train.learning_rate=inf"], "train.learning_rate must be a finite number >= 0"),
        (["train.min_lr=0.5", "train.learning_rate=0.1"], "must not exceed train.learning_rate"),
        (["train.batch_size=0"], "train.batch_size must be >= 1"),
        (["model.dropout=1"], "model.dropout must be in [0, 1)"),
        (["train.ema_decay=1"], "train.ema_decay must be in [0, 1)"),
        (["train.ema_decay=-0.5"], "train.ema_decay must be in [0, 1)"),
        (["train.ema_decay=nan"], "train.ema_decay must be in [0, 1)"),
        (["train.optimizer=Muon"], "train.optimizer must be one of adamw, muon; got 'Muon'"),
        (["model.attention=flash"], "model.attention must be one of"),
        (["train.device=tpu"], "train.device must be one of"),
        (["out_dir="], "out_dir is empty"),
        (["out_dir=  "], "out_dir is empty"),
        ([f"seed={2**70}"], "seed must fit in a signed 64-bit integer"),
    ],
)
def test_an_impossible_value_is_refused_in_one_line(overrides, fragment):
    assert fragment in refused(TINY, overrides)


def test_a_value_the_overrides_fix_is_checked_with_them(tmp_path):
    path = write_yaml(tmp_path, "model:\n  n_layer: 1\n  n_embd: 30\n  n_head: 4\n")
    assert load_config(str(path), ["model.n_head=3"]).model.n_head == 3
    assert load_config(str(path), ["model.n_embd=32"]).model.n_embd == 32
    # left as it is, the file's pair is refused and blamed on the file
    message = refused(path, ["seed=3"])
    assert "divisible" in message and message.endswith(f"(in {shown(path)})")


def test_a_template_that_leaves_data_path_to_the_command_line_runs_with_it(tmp_path):
    path = write_yaml(tmp_path, "# for your own text: give data.path=... on the command line\ndata:\n  dataset: null\n")
    cfg = load_config(str(path), ["data.path=my_text.txt"])
    assert (cfg.data.path, cfg.data.dataset) == ("my_text.txt", None)
    assert refused(path).startswith("no training text: give data.path")


def test_the_files_own_keys_and_types_are_still_checked_before_the_overrides(tmp_path):
    # an override of the right key does not excuse a misspelt or mistyped one in the file
    misspelt = write_yaml(tmp_path, "model:\n  n_layr: 2\n", name="misspelt.yaml")
    assert refused(misspelt, ["model.n_layer=2"]).startswith("unknown config key 'model.n_layr'")
    mistyped = write_yaml(tmp_path, "model:\n  n_layer: two\n", name="mistyped.yaml")
    assert refused(mistyped, ["model.n_layer=2"]) == (
        f"model.n_layer must be an integer, got 'two' (in {shown(mistyped)})")


def test_config_file_missing_or_a_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # short relative names, quoted whole
    (tmp_path / "runs.yaml").mkdir()
    assert refused("nope.yaml") == "config file: no such file 'nope.yaml'"
    assert refused("runs.yaml").startswith("config file: 'runs.yaml' is a folder, not a file")
    # '-' is standard input in many tools: "no such file '-'" did not say this one reads files alone
    assert refused("-") == ("config file reads a file, not standard input ('-'); save the text in a file and give its "
                            "path")
    (tmp_path / "-").write_text("train:\n  max_iters: 7\n", encoding="utf-8")  # a file of that name is read
    assert load_config("-", []).train.max_iters == 7


# ------------------------------------------------------------------------------------------- safe loading


@pytest.mark.parametrize(
    "tag",
    [
        "!!python/object/apply:builtins.open [{marker!r}, w]",
        "!!python/object/new:builtins.open [{marker!r}, w]",
        "!!python/object:training.config.RunConfig {{}}",
    ],
)
def test_python_tags_are_refused_not_executed(tmp_path, tag):
    marker = str(tmp_path / "marker")
    path = write_yaml(tmp_path, "seed: " + tag.format(marker=marker) + "\n")
    assert "not valid YAML" in refused(path)
    assert not Path(marker).exists()
    if "open" in tag:  # the payload is live: an unsafe loader would have run it
        yaml.unsafe_load(path.read_text(encoding="utf-8"))["seed"].close()
        assert Path(marker).exists()


# ------------------------------------------------------------------------------------- numbers and types


def test_exponent_numbers_pyyaml_reads_as_strings_are_accepted(tmp_path):
    text = "train:\n  learning_rate: 3e-4\n  min_lr: 1e-5\n  max_iters: 1e3\n"
    assert yaml.safe_load(text)["train"]["learning_rate"] == "3e-4"  # the premise: YAML 1.1 wants a dot
    cfg = load_config(str(write_yaml(tmp_path, text)), [])
    assert cfg.train.learning_rate == 3e-4 and isinstance(cfg.train.learning_rate, float)
    assert cfg.train.min_lr == 1e-5
    assert cfg.train.max_iters == 1000 and isinstance(cfg.train.max_iters, int)


@pytest.mark.parametrize(("spelling", "count"), [("1e18", 10**18), ("1.0e+18", 10**18), ("9.2e+18", 92 * 10**17),
                                                 ("2.0", 2), ("1_000.0", 1000), ("10e-1", 1),
                                                 ("9007199254740993.0", 2**53 + 1), ("+1.5E+18", 15 * 10**17)])
def test_a_count_in_exponent_notation_is_the_same_integer_in_the_file_and_on_the_command_line(tmp_path, spelling,
                                                                                               count):
    # YAML reads 1.0e+18 as a float and 1e18 as a string: both are the count written, exactly (float(1e23) is not
    # 10**23), in the file as on the command line; once the file's 1.0e+18 was refused ("must be an integer") and
    # the command line's taken
    from_file = load_config(str(write_yaml(tmp_path, f"train:\n  max_iters: {spelling}\n")), [])
    from_line = load_config(str(TINY), [f"train.max_iters={spelling}"])
    assert from_file.train.max_iters == from_line.train.max_iters == count
    assert coerce("1e23", int, "seed", from_text=True) == coerce(1e23, int, "seed") == 10**23


@pytest.mark.parametrize("spelling", ["1.5", "1e-3", "1e400", "1e-400", ".inf", "nan"])
def test_a_count_that_is_not_an_integer_is_refused_in_the_file_and_on_the_command_line(tmp_path, spelling):
    assert "train.max_iters must be an integer" in refused(write_yaml(tmp_path, f"train:\n  max_iters: {spelling}\n"))
    assert "train.max_iters must be an integer" in refused(TINY, [f"train.max_iters={spelling}"])


def test_a_count_is_read_from_the_digits_written_not_from_the_float_yaml_makes_of_them(tmp_path):
    # YAML reads 1.0000000000000000001 as the float 1.0, and 9007199254740993.0 as 9007199254740992.0; the command
    # line's text keeps every digit, and once the file's number was taken as the float's count, 1 and 2**53
    spelling = "1.0000000000000000001"
    message = refused(write_yaml(tmp_path, f"train:\n  max_iters: {spelling}\n"))
    assert message.startswith(f"train.max_iters must be an integer, got {spelling} (in ")  # as written, unquoted
    assert "train.max_iters must be an integer" in refused(TINY, [f"train.max_iters={spelling}"])
    # only counts: a float setting is the float, a text setting the text, as before
    cfg = load_config(str(write_yaml(tmp_path, f"train:\n  learning_rate: {spelling}\n  eval_interval: 4.0\n"
                                               f"out_dir: 2.50\n")), [])
    assert (cfg.train.learning_rate, cfg.train.eval_interval, cfg.out_dir) == (1.0, 4, "2.50")
    assert type(cfg.train.learning_rate) is float and type(cfg.train.eval_interval) is int


def test_an_integer_is_a_fine_float(tmp_path):
    cfg = load_config(str(write_yaml(tmp_path, "train:\n  learning_rate: 1\n  min_lr: 0\n")), [])
    assert cfg.train.learning_rate == 1.0 and isinstance(cfg.train.learning_rate, float)
    assert cfg.train.min_lr == 0.0 and isinstance(cfg.train.min_lr, float)


def test_overrides_are_typed_by_the_field_they_set():
    cfg = load_config(
        str(TINY),
        [
            "train.max_iters=500",
            "model.bias=false",
            "train.lr_decay_iters=null",
            "train.learning_rate=3e-2",
            "seed=7",
            "train.grad_clip=2",
            "model.attention=fused",
        ],
    )
    assert cfg.train.max_iters == 500 and cfg.model.bias is False and cfg.train.lr_decay_iters is None
    assert cfg.train.learning_rate == 3e-2 and cfg.seed == 7
    assert cfg.train.grad_clip == 2.0 and isinstance(cfg.train.grad_clip, float)
    assert cfg.model.attention == "fused"
    # and the later of two overrides of one key wins
    assert load_config(str(TINY), ["seed=1", "seed=2"]).seed == 2


def test_overrides_leave_the_rest_of_the_file_alone():
    base = load_config(str(TINY), [])
    changed = load_config(str(TINY), ["train.batch_size=3"])
    assert changed.train.batch_size == 3
    assert replace(changed, train=replace(changed.train, batch_size=base.train.batch_size)) == base


# ------------------------------------------------------------------------------------------- out_dir, data


def test_out_dir_defaults_to_runs_and_the_config_stem(tmp_path):
    path = write_yaml(tmp_path, "seed: 1\n", name="my_experiment.yaml")
    assert load_config(str(path), []).out_dir == str(Path("runs") / "my_experiment")
    with_dir = write_yaml(tmp_path, "out_dir: elsewhere\n", name="other.yaml")
    assert load_config(str(with_dir), []).out_dir == "elsewhere"
    assert load_config(str(with_dir), ["out_dir=third"]).out_dir == "third"


def test_a_data_path_on_the_command_line_wins_over_the_configs_dataset():
    plain = load_config(str(TINY), [])
    assert plain.data.dataset == "shakespeare_char" and plain.data.path is None
    cfg = load_config(str(TINY), ["data.path=my_text.txt"])
    assert cfg.data.path == "my_text.txt" and cfg.data.dataset is None


def test_a_dataset_on_the_command_line_wins_over_the_files_data_path(tmp_path):
    path = write_yaml(tmp_path, "data:\n  path: my_text.txt\n  dataset: null\n")
    cfg = load_config(str(path), ["data.dataset=shakespeare_char"])
    assert cfg.data.dataset == "shakespeare_char" and cfg.data.path is None


def test_a_file_with_both_reads_and_records_its_data_path_alone(tmp_path):
    path = write_yaml(tmp_path, "data:\n  path: my_text.txt\n  dataset: shakespeare_char\n")
    cfg = load_config(str(path), [])
    assert cfg.data.path == "my_text.txt" and cfg.data.dataset is None


def test_data_path_and_dataset_both_on_the_command_line_are_refused():
    assert refused(TINY, ["data.path=my_text.txt", "data.dataset=shakespeare_char"]) == (
        "data.path and data.dataset are both given on the command line (data.path=my_text.txt "
        "data.dataset=shakespeare_char); give one of them")
    # unsetting one of them is not giving both
    assert load_config(str(TINY), ["data.path=null", "data.dataset=shakespeare_char"]).data.path is None


def test_out_dir_in_a_file_expands_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = write_yaml(tmp_path, "out_dir: ~/runs/exp\n")
    assert load_config(str(path), []).out_dir == str(tmp_path / "home" / "runs" / "exp")
    assert load_config(str(TINY), ["out_dir=~/x"]).out_dir == str(tmp_path / "home" / "x")
    assert load_config(str(TINY), ["out_dir=a~b"]).out_dir == "a~b"


def test_an_empty_file_gives_the_defaults(tmp_path):
    cfg = load_config(str(write_yaml(tmp_path, "")), [])
    assert replace(cfg, out_dir=None) == RunConfig()


def test_a_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(str(TINY), ["train.lr_decay_iters=700", "out_dir=x", "model.dropout=0.1"])
    path = write_yaml(tmp_path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
    assert load_config(str(path), []) == cfg


def test_valid_keys_are_the_dotted_leaves_and_build_refuses_a_derived_one():
    keys = valid_keys(RunConfig)
    assert "train.learning_rate" in keys and "out_dir" in keys and "data.path" in keys
    assert not any(k in keys for k in ("train", "model", "data", "model.vocab_size"))
    # vocab_size comes from the data, so a config may not set it
    with pytest.raises(ConfigError, match="model.vocab_size"):
        build(RunConfig, {"model": {"vocab_size": 10}})
    with pytest.raises(ConfigError, match="model.vocab_size"):
        apply_overrides({}, ["model.vocab_size=10"], RunConfig)


def test_an_option_of_sample_py_given_to_train_py_says_where_it_belongs(capsys):
    # `train.py --attention-map x.png` was told "settings are KEY=VALUE words, not options: model.attention=x.png",
    # which only gave a second error; --max-new-tokens was taken for train.max_iters, --prompt for model.dropout
    import train

    with pytest.raises(SystemExit) as exited:
        train.parse_args(["--attention-map", "x.png"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        "error: unrecognized arguments: --attention-map; train.py logs the attention grid to TensorBoard; for a "
        "picture file use python sample.py --out-dir RUN --attention-map FILE (see train.py --help)\n")
    keys, own = valid_keys(RunConfig), {"--config", "--resume", "--overwrite", "--out-dir", "-h", "--help"}
    assert option_as_setting(["--attention-values"], keys, own) == option_as_setting(["--attention-map=a"], keys, own)
    for option in ("--max-new-tokens", "--prompt", "--num-samples", "--stream", "--prompt-file"):
        assert option_as_setting([option, "5"], keys, own) == (
            f"; {option} is an option of sample.py, which samples a trained run: python sample.py --out-dir RUN "
            f"{option} ...")
    # sample.py takes --checkpoint instead of --out-dir, and train.py's own way to go on from one is --resume
    assert option_as_setting(["--checkpoint", "runs/x/ckpt.pt"], keys, own) == (
        "; train.py --resume continues the run in --out-dir; to sample a checkpoint file use python sample.py "
        "--checkpoint FILE")
    # other trainers' names for a setting, which the spelling alone no longer reaches
    assert option_as_setting(["--data", "input.txt"], keys, own).endswith(": data.path=input.txt")
    assert option_as_setting(["--accumulation-steps", "3"], keys, own).endswith(": train.grad_accum_steps=3")


def test_sample_options_are_the_options_of_sample_py_that_train_py_lacks(monkeypatch):
    import sample
    import train
    from configs.names import SAMPLE_OPTIONS
    from configs.userinput import OneLineParser

    class Parsed(Exception):
        pass

    def options(parser: OneLineParser, argv: list[str]) -> None:
        raise Parsed(set(parser._option_string_actions))

    monkeypatch.setattr(OneLineParser, "parse_args", options)
    monkeypatch.setattr(OneLineParser, "parse_intermixed_args", options)
    found = []
    for module in (sample, train):
        with pytest.raises(Parsed) as parsed:
            module.parse_args([])
        found.append(parsed.value.args[0])
    sampling, training = found
    settings = {"--" + key.rpartition(".")[2].replace("_", "-") for key in valid_keys(RunConfig)}
    assert {"--seed", "--device", "--compile"} <= settings  # sample.py's, and settings of train.py's: seed=3
    assert set(SAMPLE_OPTIONS) == sampling - training - settings


def test_an_option_far_from_every_setting_gets_no_guess_and_a_near_one_still_does():
    keys, own = valid_keys(RunConfig), {"--config"}
    for far in ("--logdir", "--heatmap", "--resume-from", "--sample"):  # were out_dir, -, -, train.sample_chars
        assert option_as_setting([far, "x"], keys, own) == "", far
    for near, setting in (("--optim", "train.optimizer"), ("--learning-rat", "train.learning_rate"),
                          ("--blocksize", "model.block_size"), ("--lr", "train.learning_rate"), ("--seed", "seed")):
        assert option_as_setting([near, "3"], keys, own) == f"; settings are KEY=VALUE words, not options: {setting}=3"
