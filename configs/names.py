"""Names for a setting: the valid key a misspelt or foreign one most likely meant, and a setting written as an
option."""

from __future__ import annotations

import difflib

from .userinput import shown

# What other trainers call a setting, by its last part: spelling alone led astray (train.lr was taken for
# train.min_lr, train.steps for train.threads, data.file for data.errors, model.d_model for model.score).
OTHER_NAMES = {
    **dict.fromkeys(("lr", "max_lr", "learning-rate", "peak_lr"), "train.learning_rate"),
    **dict.fromkeys(("steps", "max_steps", "num_steps", "iters", "iterations", "epochs", "num_epochs",
                     "train_steps", "total_steps"), "train.max_iters"),
    **dict.fromkeys(("bs", "batch", "micro_batch_size", "batch-size"), "train.batch_size"),
    **dict.fromkeys(("warmup", "warmup_steps"), "train.warmup_iters"),
    **dict.fromkeys(("wd",), "train.weight_decay"),
    **dict.fromkeys(("clip", "max_grad_norm", "clip_grad_norm", "grad_norm_clip"), "train.grad_clip"),
    **dict.fromkeys(("eval_every", "eval_steps", "eval_freq"), "train.eval_interval"),
    **dict.fromkeys(("log_every", "log_steps", "log_freq"), "train.log_interval"),
    **dict.fromkeys(("d_model", "dim", "hidden_size", "hidden", "embed_dim", "emb_dim", "n_embed", "width"),
                    "model.n_embd"),
    **dict.fromkeys(("layers", "n_layers", "num_layers", "depth"), "model.n_layer"),
    **dict.fromkeys(("heads", "n_heads", "num_heads"), "model.n_head"),
    **dict.fromkeys(("context", "context_length", "context_size", "ctx_len", "seq_len", "max_seq_len", "block",
                     "sequence_length"), "model.block_size"),
    **dict.fromkeys(("file", "input", "input_file", "text", "corpus", "data", "data_path", "train_file",
                     "dataset_path"), "data.path"),
    **dict.fromkeys(("accumulation_steps", "gradient_accumulation_steps", "grad_accum", "accum_steps"),
                    "train.grad_accum_steps"),
    **dict.fromkeys(("out", "output", "output_dir", "outdir", "save_dir", "checkpoint_dir", "ckpt_dir"), "out_dir"),
}


# sample.py's own options, which train.py does not take: told where they belong, not taken for the setting nearest in
# spelling (--attention-map was model.attention=x.png, --max-new-tokens train.max_iters, --prompt model.dropout).
SAMPLE_OPTIONS = ("--attention-map", "--attention-values", "--prompt", "--prompt-file", "--num-samples",
                  "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--checkpoint", "--stream", "--no-cache")
# How close an option's spelling must be to a setting's to be offered as the one meant: at the 0.6 that a misspelt
# key gets, a name far from every setting got one all the same (--stream: train.threads, --logdir: out_dir).
OPTION_CUTOFF = 0.7


def nearest(key: str, candidates: list[str], cutoff: float = 0.6) -> str | None:
    """The valid key a misspelt one most likely meant: another trainer's name for it (OTHER_NAMES), a key whose last
    part it ends in (learning_rate: train.learning_rate), the closest spelling among its own section's keys (the
    section's name in common made train.adam look like train.threads), else the closest whole dotted key (a
    misspelt section: trian.max_iters) or last part; a spelling counts as close from cutoff (difflib's ratio) up."""
    # The key in other capitals (SEED, TRAIN.MAX_ITERS, a file's 'TRAIN:'): difflib compares case and all, and found
    # no key close to them, so the line pointed at --help
    by_case = {c.lower(): c for c in candidates}
    if key.lower() in by_case and by_case[key.lower()] != key:
        return by_case[key.lower()]
    section, _, last = key.rpartition(".")
    if OTHER_NAMES.get(last.lower()) in candidates:
        return OTHER_NAMES[last.lower()]
    same = [c for c in candidates if c.rpartition(".")[2] == last and c != key]
    if same:
        return same[0]
    if section and any(c.startswith(section + ".") for c in candidates):
        by_last = {c.rpartition(".")[2]: c for c in candidates if c.rpartition(".")[0] == section}
        match = difflib.get_close_matches(last, list(by_last), n=1, cutoff=cutoff)
        return by_last[match[0]] if match else None
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=cutoff)
    if match:
        return match[0]
    by_last = {c.rpartition(".")[2]: c for c in candidates}
    match = difflib.get_close_matches(last, list(by_last), n=1, cutoff=cutoff)
    return by_last[match[0]] if match else None


def option_as_setting(argv: list[str], keys: list[str], options: set[str]) -> str:
    """For a setting written as an option (--max_iters 3, --train.max_iters=3), which argparse calls an unrecognized
    argument: '; ...' saying how it is written (train.max_iters=3), or where an option of sample.py belongs
    (SAMPLE_OPTIONS), or '' for nothing of the kind in argv. options: the command's own options, which are no
    settings; keys: the valid dotted keys."""
    for at, word in enumerate(argv):
        name, equals, value = word[2:].partition("=")
        if not word.startswith("--") or not name or word.partition("=")[0] in options:
            continue
        if word.partition("=")[0] in SAMPLE_OPTIONS:
            return sample_option_hint(word.partition("=")[0])
        if not equals and at + 1 < len(argv) and not argv[at + 1].startswith("-") and "=" not in argv[at + 1]:
            value = argv[at + 1]
        key = name.replace("-", "_")
        key = key if key in keys else nearest(key, keys, cutoff=OPTION_CUTOFF)
        if key is not None:
            return f"; settings are KEY=VALUE words, not options: {key}={shown(value or 'VALUE', 40)}"
    return ""


def sample_option_hint(option: str) -> str:
    """'; ...' for one of sample.py's options given to train.py: where it belongs."""
    if option == "--checkpoint":  # (sample.py takes it or --out-dir, not both)
        return ("; train.py --resume continues the run in --out-dir; to sample a checkpoint file use python sample.py "
                "--checkpoint FILE")
    if option.startswith("--attention-"):
        return ("; train.py logs the attention grid to TensorBoard; for a picture file use python sample.py --out-dir "
                "RUN --attention-map FILE")
    return (f"; {option} is an option of sample.py, which samples a trained run: python sample.py --out-dir RUN "
            f"{option} ...")
