"""model/checkpoint.py: checkpoints are self-describing, read back with weights_only, and every damaged, foreign or
unsafe file is refused with a one-line CheckpointError."""

from __future__ import annotations

import builtins
import os
import pickle
import shlex
import struct
import threading
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from model import GPT, CheckpointError, GPTConfig, find_checkpoint, load_checkpoint, model_from_checkpoint
from model import checkpoint as checkpoint_module
from model.checkpoint import quoted
from training.checkpoints import save_checkpoint

VOCAB = list("\n !,.:?ABCabcdefghij")


def tiny_model(**kw) -> GPT:
    cfg = {"vocab_size": len(VOCAB), "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16, "dropout": 0.0}
    cfg.update(kw)
    torch.manual_seed(0)
    return GPT(GPTConfig(**cfg)).eval()


def payload_for(model: GPT, vocab: list[str] = VOCAB, **extra) -> dict:
    return {"model": model.state_dict(), "model_config": model.config.to_dict(), "vocab": list(vocab), **extra}


@pytest.fixture
def saved(tmp_path) -> tuple[GPT, Path]:
    model = tiny_model()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(payload_for(model, step=7, best_val_loss=1.25), path)
    return model, path


def refusal(path: Path) -> str:
    with warnings.catch_warnings(record=True) as caught, pytest.raises(CheckpointError) as info:
        warnings.simplefilter("always")
        model_from_checkpoint(load_checkpoint(path), path)
    # a warning would print on stderr next to the error line (torch warns about foreign pickle protocols)
    assert [str(w.message) for w in caught] == []
    message = str(info.value)
    assert message and "\n" not in message and "\x1b" not in message  # one plain line, no terminal escapes
    return message


class WritesAFile:
    """Unpickling this would open (so create) a marker file: code run by merely loading a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.open, (self.marker, "w"))


# ------------------------------------------------------------------------------------------- round trip


def test_round_trip_gives_identical_logits_and_vocabulary(saved):
    model, path = saved
    payload = load_checkpoint(path)
    loaded, vocab = model_from_checkpoint(payload, path)
    assert vocab == VOCAB
    assert loaded.config == model.config
    idx = torch.randint(0, len(VOCAB), (3, 8), generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded.eval()(idx)[0], model(idx)[0])
    # the trainer's extras come back as they went in
    assert payload["step"] == 7 and payload["best_val_loss"] == 1.25


def test_a_checkpoint_is_plain_data_for_torch_load_weights_only(saved):
    _, path = saved
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == "tinychar-checkpoint" and isinstance(raw["version"], int)
    assert raw["vocab"] == VOCAB and isinstance(raw["model_config"], dict)


def test_a_loaded_model_with_another_shape_round_trips_too(tmp_path):
    model = tiny_model(n_layer=1, n_head=4, n_embd=8, bias=False, attention="fused", block_size=5)
    path = tmp_path / "other.pt"
    save_checkpoint(payload_for(model), path)
    loaded, _ = model_from_checkpoint(load_checkpoint(path), path)
    idx = torch.randint(0, len(VOCAB), (2, 5))
    assert torch.equal(loaded.eval()(idx)[0], model(idx)[0])


# ------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("keep", [0.5, 0.1, 100, 0])
def test_a_truncated_file_is_refused(saved, keep):
    _, path = saved
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    message = refusal(path)
    assert "truncated or not a checkpoint" in message and quoted(path) in message


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(lambda p: torch.save({"weights": torch.zeros(3)}, p), id="foreign-dict"),
        pytest.param(lambda p: torch.save(torch.zeros(3), p), id="bare-tensor"),
        pytest.param(lambda p: torch.save({"format": "tinychar-checkpoint", "model": {}}, p), id="lacks-keys"),
        pytest.param(lambda p: p.write_text("hello, I am text", encoding="utf-8"), id="text-file"),
        pytest.param(
            lambda p: p.write_bytes(pickle.dumps({"format": "tinychar-checkpoint"}, protocol=4)), id="plain-pickle"
        ),
    ],
)
def test_a_file_that_is_not_a_tinychar_checkpoint_is_refused(tmp_path, content):
    path = tmp_path / "x.pt"
    content(path)
    message = refusal(path)
    assert quoted(path) in message


def test_a_missing_file_or_a_folder_is_refused(tmp_path):
    assert "no checkpoint" in refusal(tmp_path / "nope.pt")
    assert refusal(tmp_path).endswith("is a folder, not a checkpoint file; name the checkpoint in it (ckpt.pt, or "
                                      "best.pt)")


def test_a_pipe_is_refused_before_it_is_opened(tmp_path):
    # a FIFO with no writer made torch.load wait in open() forever; refused from its stat, it is never opened
    fifo = tmp_path / "best.pt"
    os.mkfifo(fifo)
    outcome: list[str] = []
    reader = threading.Thread(target=lambda: outcome.append(refusal(fifo)), daemon=True)
    reader.start()
    reader.join(timeout=20)
    if reader.is_alive():  # the old behaviour: release the blocked open() before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=20)
        pytest.fail("load_checkpoint blocked opening a FIFO")
    assert outcome == [f"{quoted(fifo)} is a pipe (a FIFO, or <(command) in a shell), not a checkpoint file; give "
                       f"the path of a file torch.save wrote"]

    # <(cat ckpt.pt) in a shell: /dev/fd/N, an anonymous pipe (it was called "truncated or not a checkpoint")
    read_end, write_end = os.pipe()
    os.close(write_end)
    try:
        assert "is a pipe" in refusal(Path(f"/dev/fd/{read_end}"))
    finally:
        os.close(read_end)


def test_a_device_is_refused_as_what_it_is():
    assert "is a character device, not a checkpoint file" in refusal(Path("/dev/null"))


def test_a_checkpoint_with_compressed_entries_is_refused_before_it_is_expanded(saved, tmp_path):
    # torch.load inflates deflated entries (a 2 MB file of zeros took 400 MB); torch.save never writes them
    _, path = saved
    deflated = tmp_path / "deflated.pt"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as out:
        for entry in source.infolist():
            out.writestr(entry.filename, source.read(entry.filename))
    assert torch.load(deflated, weights_only=True)["vocab"] == VOCAB  # torch would read it
    message = refusal(deflated)
    assert message.startswith(f"checkpoint {quoted(deflated)} holds compressed data (")
    assert "refusing to load it" in message


def test_a_checkpoint_whose_entries_claim_more_than_the_file_holds_is_refused(saved, tmp_path):
    _, path = saved
    data = bytearray(path.read_bytes())
    # the central directory's record of the largest entry (the weights) says it is ten times the file's size
    largest = max(zipfile.ZipFile(path).infolist(), key=lambda e: e.file_size).filename.encode()
    at = next(i for i in range(len(data)) if data.startswith(b"PK\x01\x02", i)
              and data[i + 46 : i + 46 + struct.unpack_from("<H", data, i + 28)[0]] == largest)
    struct.pack_into("<II", data, at + 20, 10 * len(data), 10 * len(data))  # compressed and uncompressed sizes
    lying = tmp_path / "lying.pt"
    lying.write_bytes(bytes(data))
    assert f"bytes of data in a file of {len(data):,} bytes; it is damaged or crafted" in refusal(lying)


@pytest.mark.parametrize(("change", "reason"), [
    (lambda w: w.pop("lm_head.weight"), 'Missing key(s) in state_dict: "lm_head.weight".'),
    (lambda w: w.update({"extra.weight": torch.zeros(2)}), 'Unexpected key(s) in state_dict: "extra.weight".'),
    (lambda w: w.update({"transformer.ln_f.bias": torch.tensor(1.0)}),
     "size mismatch for transformer.ln_f.bias: copying a param with shape torch.Size([]) from checkpoint, the shape "
     "in current model is torch.Size([16])."),
    (lambda w: w.update({"transformer.ln_f.bias": "x"}), 'While copying the parameter named "transformer.ln_f.bias"'),
    (lambda w: w.update({"odd\nkey": torch.zeros(1)}), 'Unexpected key(s) in state_dict: "odd\\nkey".'),  # escaped
    (lambda w: [w.pop(k) for k in list(w) if k.startswith("transformer.h.1.")],
     'Missing key(s) in state_dict: "transformer.h.1.ln_1.weight", "transformer.h.1.ln_1.bias", '),  # cut, below
])
def test_weights_that_do_not_fit_the_config_are_refused_with_torchs_reason(saved, tmp_path, change, reason):
    # the message used to stop at torch's first line, "Error(s) in loading state_dict for GPT:", which says nothing
    model, _ = saved
    payload = payload_for(model)
    payload["model"] = dict(payload["model"])
    change(payload["model"])
    path = tmp_path / "mismatch.pt"
    save_checkpoint(payload, path)
    message = refusal(path)
    prefix = f"checkpoint {quoted(path)} weights do not match its model config: "
    assert message.startswith(prefix + reason)
    assert len(message) <= len(prefix) + 160 and "Error(s) in loading" not in message


@pytest.mark.parametrize(("key", "value", "name"), [
    ("transformer.ln_f.weight", float("nan"), "transformer.ln_f.weight"),
    ("lm_head.weight", float("inf"), "transformer.wte.weight"),  # tied: the parameter's first name
    # tied, and overwritten on loading by the head's finite copy: it went through, into the weights' average, which
    # reads the saved tensors, and a resumed run saved NaN weights with exit status 0
    ("transformer.wte.weight", float("nan"), "transformer.wte.weight"),
    ("transformer.h.1.mlp.c_fc.bias", -float("inf"), "transformer.h.1.mlp.c_fc.bias"),
])
def test_weights_that_are_not_finite_are_refused_at_load(saved, tmp_path, monkeypatch, key, value, name):
    # they loaded, and sampling crashed in torch.multinomial (or drew garbage on the fixed-shape path)
    model, _ = saved
    payload = payload_for(model)
    payload["model"] = {k: v.clone() for k, v in payload["model"].items()}
    payload["model"][key].view(-1)[-1] = value  # one value, the last: in the last chunk checked
    path = tmp_path / "nan.pt"
    save_checkpoint(payload, path)
    monkeypatch.setattr(checkpoint_module, "FINITE_CHUNK", 5)  # several chunks a weight
    assert refusal(path) == (f"checkpoint {quoted(path)} holds weights that are not finite (NaN or infinite) in "
                             f"{name}; it is damaged (training stops before saving such weights)")


def test_a_value_too_large_for_the_models_float32_is_not_finite_either(saved, tmp_path):
    model, _ = saved
    payload = payload_for(model)
    payload["model"] = dict(payload["model"])
    payload["model"]["transformer.ln_f.bias"] = torch.full((16,), 1e300, dtype=torch.float64)  # inf once cast
    path = tmp_path / "huge.pt"
    save_checkpoint(payload, path)
    assert "not finite (NaN or infinite) in transformer.ln_f.bias" in refusal(path)


def test_complex_weights_are_refused_not_cut_to_their_real_part(saved, tmp_path):
    model, _ = saved
    payload = payload_for(model)
    payload["model"] = dict(payload["model"])
    payload["model"]["transformer.ln_f.bias"] = torch.zeros(16, dtype=torch.complex64)
    path = tmp_path / "complex.pt"
    save_checkpoint(payload, path)
    assert refusal(path).endswith("holds complex numbers as weights ('transformer.ln_f.bias'); it is damaged or from "
                                  "another program")


@pytest.mark.parametrize("key", [0, ("transformer", "ln_f"), 2.5, None, b"transformer.ln_f.bias"])
def test_a_weight_named_by_anything_but_a_string_is_refused(saved, tmp_path, key):
    # load_state_dict took every name for a string: an AttributeError traceback from its prefix check ('int' object
    # has no attribute 'startswith')
    model, _ = saved
    payload = payload_for(model)
    payload["model"] = {**payload["model"], key: torch.zeros(1)}
    path = tmp_path / "odd-name.pt"
    save_checkpoint(payload, path)
    assert refusal(path) == (f"checkpoint {quoted(path)} names a weight by a value of type {type(key).__name__}, not "
                             f"by a string; it is damaged or from another program")


@pytest.mark.parametrize(("dtype", "kind"), [(torch.bool, "booleans"), (torch.int64, "integers"),
                                             (torch.uint8, "integers")])
def test_integer_or_boolean_weights_are_refused_not_taken_as_numbers(saved, tmp_path, dtype, kind):
    # load_state_dict copied them into the float weights without a word (True as 1.0), and sample.py sampled from them
    model, _ = saved
    payload = payload_for(model)
    payload["model"] = dict(payload["model"])
    payload["model"]["transformer.ln_f.bias"] = torch.ones(16, dtype=dtype)
    path = tmp_path / "integers.pt"
    save_checkpoint(payload, path)
    assert refusal(path).endswith(f"holds {kind} as weights ('transformer.ln_f.bias'); it is damaged or from another "
                                  f"program")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_weights_of_8_bit_floats_are_refused_naming_their_type(saved, tmp_path, dtype):
    # a NotImplementedError traceback from the finite check: torch has no isfinite for them
    model, _ = saved
    payload = payload_for(model)
    payload["model"] = dict(payload["model"])
    payload["model"]["transformer.ln_f.bias"] = torch.zeros(16).to(dtype)
    path = tmp_path / "float8.pt"
    save_checkpoint(payload, path)
    name = str(dtype).removeprefix("torch.")
    assert refusal(path).endswith(f"holds {name} numbers as weights ('transformer.ln_f.bias'); it is damaged or from "
                                  f"another program")


@pytest.mark.parametrize(("make", "kind"), [(lambda t: t.to_sparse(), "a sparse tensor"),
                                           (lambda t: t.to("meta"), "a tensor with no values (on the meta device)")])
def test_sparse_or_meta_weights_are_refused_saying_so(saved, tmp_path, make, kind):
    # load_state_dict's refusal was cut off behind a line of two equal shapes, before its reason
    model, _ = saved
    payload = payload_for(model)
    payload["model"] = dict(payload["model"])
    payload["model"]["transformer.ln_f.bias"] = make(payload["model"]["transformer.ln_f.bias"])
    path = tmp_path / "odd-layout.pt"
    save_checkpoint(payload, path)
    assert refusal(path).endswith(f"holds {kind} as weights ('transformer.ln_f.bias'); it is damaged or from another "
                                  f"program")


@pytest.mark.parametrize(("version", "fragment"), [
    (2, "is in format version 2, newer than this tinychar reads (1); load it with the tinychar that wrote it"),
    (10**400, "is in format version a far later one, newer than this tinychar reads (1)"),
    ("1", "has a damaged format version (not an integer)"),
    (0, "has a damaged format version (below 1, the first)"),
    (-5, "has a damaged format version (below 1, the first)"),
    (-10**400, "has a damaged format version (below 1, the first)"),
    (True, "has a damaged format version (not an integer)"),
])
def test_a_checkpoint_of_an_unknown_format_version_is_refused(saved, tmp_path, version, fragment):
    model, _ = saved
    path = tmp_path / "future.pt"
    torch.save({"format": "tinychar-checkpoint", "version": version, **payload_for(model)}, path)
    assert refusal(path).startswith(f"checkpoint {quoted(path)} {fragment}")
    # without a version (a hand-made file) it loads, as every version-1 checkpoint does
    torch.save({"format": "tinychar-checkpoint", **payload_for(model)}, path)
    assert model_from_checkpoint(load_checkpoint(path), path)[1] == VOCAB


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_a_pickle_that_would_run_code_is_refused_and_never_run(tmp_path, writer):
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pt"
    payload = {"format": "tinychar-checkpoint", "model": WritesAFile(marker), "model_config": {}, "vocab": []}
    if writer == "torch.save":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload, protocol=2))
    assert not marker.exists()
    assert "refusing to load" in refusal(path)
    assert not marker.exists()
    # the payload is live: an unsafe load does run it, so the check above is not vacuous
    unsafe = torch.load(path, weights_only=False) if writer == "torch.save" else pickle.loads(path.read_bytes())
    unsafe["model"].close()
    assert marker.exists()


def test_a_vocabulary_that_does_not_match_the_weights_is_refused(saved, tmp_path):
    model, _ = saved
    short = tmp_path / "short.pt"
    save_checkpoint(payload_for(model, vocab=VOCAB[:-1]), short)
    assert "inconsistent" in refusal(short)

    # vocabulary and config agree with each other but not with the embedding rows
    both = tmp_path / "both.pt"
    payload = payload_for(model, vocab=VOCAB[:-1])
    payload["model_config"]["vocab_size"] = len(VOCAB) - 1
    save_checkpoint(payload, both)
    assert "weights do not match" in refusal(both)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda p: p.update(vocab=["ab", *VOCAB[1:]]), "malformed vocabulary"),
        (lambda p: p.update(vocab="".join(VOCAB)), "malformed vocabulary"),
        # consistent with the config, but unusable: sample.py's read_prompt indexed vocab[0] of an empty one, a lone
        # surrogate failed to print after all the sampling, and a duplicate printed the wrong characters
        (lambda p: (p.update(vocab=[]), p["model_config"].update(vocab_size=0)), "malformed vocabulary: it is empty"),
        (lambda p: p.update(vocab=[VOCAB[0], "\ud800", *VOCAB[2:]]),
         "malformed vocabulary: character 1 ('\\ud800') is a lone surrogate (half of a UTF-16 pair), which UTF-8 "
         "cannot write"),
        (lambda p: p.update(vocab=[VOCAB[0], VOCAB[2], *VOCAB[2:]]),
         "malformed vocabulary: '!' is in it twice (characters 1 and 2)"),
        (lambda p: p["model_config"].update(n_head=3),
         "unusable model config: model.n_embd must be divisible by model.n_head, got 16 and 3"),
        (lambda p: p["model_config"].update(colour="blue"),
         "unusable model config: 'colour' is no setting this tinychar knows"),
        # escaped: the name's newline split the one line in two
        (lambda p: p["model_config"].update({"evil\nline2: injected": 1}),
         "unusable model config: 'evil\\nline2: injected' is no setting"),
        # n_head's default (4) fits the weights of a model of 2 heads: it would have loaded and computed otherwise
        (lambda p: p["model_config"].pop("n_head"), "unusable model config: it lacks n_head, which every checkpoint"),
        (lambda p: [p["model_config"].pop(k) for k in ("n_layer", "block_size")],
         "unusable model config: it lacks block_size, n_layer"),
        (lambda p: p["model"].pop("lm_head.weight"), "weights do not match"),
    ],
    # the changes are lambdas: pytest named them by their fragments, and the first two shared one
    ids=["a two-character entry", "a string, not a list", "empty", "a lone surrogate", "a character twice",
         "heads that do not divide the width", "an unknown setting", "a newline in a setting's name",
         "no n_head", "no block_size or n_layer", "a weight missing"],
)
def test_a_damaged_description_is_refused(saved, tmp_path, change, fragment):
    model, _ = saved
    payload = payload_for(model)
    payload["model_config"] = dict(payload["model_config"])
    payload["model"] = dict(payload["model"])
    change(payload)
    path = tmp_path / "damaged.pt"
    save_checkpoint(payload, path)
    assert fragment in refusal(path) and "\n" not in refusal(path)


def test_a_link_that_leads_nowhere_is_named_as_such_not_as_a_missing_checkpoint(tmp_path):
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    (tmp_path / "dangling.pt").symlink_to(tmp_path / "gone.pt")
    for name in ("loop1", "dangling.pt"):
        with pytest.raises(CheckpointError, match="is a symbolic link that leads to no file"):
            load_checkpoint(tmp_path / name)


@pytest.mark.parametrize("kind", ["dangling", "loop"])
@pytest.mark.parametrize("name", ["best.pt", "ckpt.pt"])
def test_a_run_folders_checkpoint_that_is_a_link_leading_nowhere_is_named_not_passed_over(saved, tmp_path, kind, name):
    # sample.py --out-dir said the folder "holds no best.pt or ckpt.pt", or took ckpt.pt in place of a best.pt in a
    # loop of links without a word
    model, _ = saved
    run = tmp_path / "run"
    run.mkdir()
    if name == "best.pt":
        save_checkpoint(payload_for(model), run / "ckpt.pt")
    if kind == "dangling":
        (run / name).symlink_to(tmp_path / "gone.pt")
    else:
        (run / name).symlink_to(run / name)
    assert find_checkpoint(run) == run / name
    with pytest.raises(CheckpointError, match="is a symbolic link that leads to no file"):
        load_checkpoint(find_checkpoint(run))


@pytest.mark.parametrize("folder", ["r" * 90, "it's -a run", "-run", "a\nrun"])
def test_the_command_that_samples_a_run_left_aside_names_its_checkpoint_whole(tmp_path, monkeypatch, folder):
    # "sample from it with --checkpoint '...'" quoted the path as a message does, cut in its middle past 80
    # characters (in a long temp folder, as on macOS, any run's), and a quote or a leading '-' in a folder's name
    # broke the command too: the word it gives must name the checkpoint when pasted back into a shell
    monkeypatch.chdir(tmp_path)
    for run in (Path(folder), tmp_path / folder):
        (run / ".replaced").mkdir(parents=True, exist_ok=True)
        (run / ".replaced" / "best.pt").write_bytes(b"the run an --overwrite replaced")
        with pytest.raises(CheckpointError) as e:
            find_checkpoint(run)
        said, command = str(e.value).split("; sample from it with ")
        assert f"waits in {quoted(run / '.replaced')}" in said and "\n" not in command
        if not folder.isprintable():  # no word on one line names it
            assert command == "--checkpoint FILE"
            continue
        word = str(run / ".replaced" / "best.pt")
        assert shlex.split(command) == ["--checkpoint", f"./{word}" if word.startswith("-") else word]


def test_a_file_of_zeros_is_not_sent_to_torchs_advice_about_its_legacy_format(tmp_path):
    (tmp_path / "zeros.pt").write_bytes(bytes(4096))  # as a sparse file of zeros reads
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "zeros.pt")
    assert str(e.value).endswith("(truncated or not a checkpoint): it is not a zip archive, as torch.save writes one")


def test_torchs_long_reasons_are_cut_at_their_first_sentence(saved, monkeypatch):
    # a truncated archive's reason, as torch gives it: it was cut at 160 characters, mid-word
    reason = ("PytorchStreamReader failed reading zip archive: failed reading file data. This is an internal miniz "
              "error. If you are seeing this error, there is a high chance that your checkpoint file is corrupted")
    monkeypatch.setattr(torch, "load", lambda *a, **k: (_ for _ in ()).throw(RuntimeError(reason)))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(saved[1])
    assert str(e.value).endswith("RuntimeError: PytorchStreamReader failed reading zip archive: failed reading file "
                                 "data.")
    # at most 160 characters, cut at a word
    assert checkpoint_module.first_sentence("word " * 50) == ("word " * 32).strip() + " ..."


# What PyTorch's CPU allocator raises when the memory left (a process limit, ulimit -v) cannot hold what it reads
NO_MEMORY = RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you "
                         "tried to allocate 681574400 bytes. Error code 12 (Cannot allocate memory)")


@pytest.mark.parametrize("error", [NO_MEMORY, MemoryError()], ids=["allocator", "MemoryError"])
def test_a_whole_checkpoint_too_large_for_the_memory_left_is_said_so_not_called_damaged(tmp_path, monkeypatch,
                                                                                        capsys, error):
    """Under `ulimit -v 1200000`, a whole 682 MB checkpoint was "truncated or not a checkpoint", and the resume advised
    --overwrite (sample.py, the run's other checkpoint): advice that would replace a good run."""
    from conftest import train_small_run

    import train

    run = train_small_run(tmp_path)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}

    def no_memory(*args, **kwargs):
        raise error

    monkeypatch.setattr(checkpoint_module.torch, "load", no_memory)
    size = (run / "ckpt.pt").stat().st_size
    with pytest.raises(checkpoint_module.NoMemoryToLoad) as refused:
        load_checkpoint(run / "ckpt.pt")
    assert str(refused.value) == (
        f"cannot load checkpoint {quoted(run / 'ckpt.pt')} ({size / 1e6:,.0f} MB): this process ran out of memory "
        f"reading it; free some memory, or raise the process's limit (ulimit -v) in the shell that starts it")
    capsys.readouterr()
    assert train.main(["--resume", "--out-dir", str(run), "train.max_iters=22"], progress=False) == 2
    assert capsys.readouterr().err == f"error: {refused.value}\n"  # no advice to replace it
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
