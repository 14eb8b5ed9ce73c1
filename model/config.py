"""GPTConfig: the shape of the model, validated when it is built."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

MODEL_TYPES = ("gpt", "bigram", "gru", "lstm")
ATTENTION_KINDS = ("manual", "fused")
SCORE_KINDS = ("dot", "additive")
NORM_PLACES = ("pre", "post")



def short_int(n: int) -> str:
    """n as a message shows it: whole up to 20 digits, past that by its first digits and its power of ten (1e100
    read as an integer was all 101 of its digits)."""
    digits = str(abs(n))
    if len(digits) <= 20:
        return str(n)
    return f"{'-' if n < 0 else ''}{digits[0]}.{digits[1:4]}e+{len(digits) - 1}"


def a_model_of(kind: str) -> str:
    """'a gpt model', 'an lstm model': a model.type in a sentence."""
    return f"{'an' if kind == 'lstm' else 'a'} {kind} model"  # of the types, only lstm is said with a vowel


def parameters_text(n: int) -> str:
    """A model's size as runs and sample.py print it: '0.15M parameters', and whole below 10,000 ('4,225
    parameters': a bigram table read '0.00M')."""
    return f"{n / 1e6:.2f}M parameters" if n >= 10_000 else f"{n:,} parameters"

def unused_setting(config: GPTConfig) -> str | None:
    """Why a new run's model config sets what its type does not use, or None: a model.dropout above 0 for a bigram
    table, which has no layers to drop out of (a run asked for dropout 0.5 trained without any, and its config.yaml
    said 0.5). Not one of GPTConfig's own checks: a checkpoint saved before may hold such a config, and still loads.
    The sizes (model.n_layer, model.n_embd) are taken and ignored, as the README says: the configs set them for the
    gpt."""
    if config.type == "bigram" and config.dropout != 0:
        return (f"model.dropout={config.dropout} means nothing for model.type=bigram, whose table has no layers to "
                f"drop out of; leave model.dropout at 0")
    return None


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Hyperparameters of the decoder-only character model.

    Each field's ``help`` metadata is its one-line meaning; ``train.py --help`` prints it.
    """

    type: str = field(default="gpt", metadata={
        "help": "gpt (the notes' transformer), bigram (a table of next-character logits), gru or lstm (recurrent "
                "models)"})
    vocab_size: int = field(default=0, metadata={"help": "number of distinct characters (set from the data)",
                                                  "derived": True})
    block_size: int = field(default=8, metadata={"help": "context length: how many characters a position can see"})
    n_layer: int = field(default=4, metadata={"help": "number of transformer blocks"})
    n_head: int = field(default=4, metadata={"help": "attention heads per block (head size = n_embd // n_head)"})
    n_embd: int = field(default=64, metadata={"help": "width of the embeddings and the residual stream"})
    dropout: float = field(default=0.0, metadata={
        "help": "dropout probability (attention weights, residuals, embeddings)"})
    bias: bool = field(default=True, metadata={"help": "use biases in linear layers and layer norms"})
    attention: str = field(default="manual", metadata={
        "help": "manual: explicit masked softmax of the notes; fused: torch scaled_dot_product_attention"})
    score: str = field(default="dot", metadata={
        "help": "attention score: dot (scaled dot product) or additive (Bahdanau, v^T tanh(W1 q + W2 k))"})
    norm: str = field(default="pre", metadata={
        "help": "where each block's layer norms go: pre (GPT-2's x + f(ln(x)), a last layer norm before the head) or "
                "post (the notes' Add & Norm, ln(x + f(x)), as in the first transformer)"})

    def __post_init__(self) -> None:
        self._check_types()
        if self.vocab_size < 0:
            raise ValueError(f"vocab_size must be >= 0, got {self.vocab_size}")
        for name in ("block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"model.{name} must be >= 1, got {value}")
            if value > 2**63 - 1:  # beyond any memory; 400 digits made the corpus's message 400 digits long
                raise ValueError(f"model.{name} must be at most 2**63 - 1, got {short_int(value)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd must be divisible by model.n_head, got {self.n_embd} and {self.n_head}")
        if self.n_embd == 1 and self.type != "bigram":  # the bigram table is vocab x vocab, whatever n_embd says
            # A layer norm over one number subtracts it from itself: every gpt, gru and lstm sends its states through
            # one before the head, so all its logits are the same whatever the text (trained on "abab...", the loss
            # stayed at ln 2).
            raise ValueError(f"model.n_embd must be >= 2 for {a_model_of(self.type)}, got 1: a layer norm over one "
                             f"number gives the same output whatever it is, so the model could not read its text")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"model.attention must be one of {', '.join(ATTENTION_KINDS)}, got {self.attention!r}")
        if self.score not in SCORE_KINDS:
            raise ValueError(f"model.score must be one of {', '.join(SCORE_KINDS)}, got {self.score!r}")
        if self.type not in MODEL_TYPES:
            raise ValueError(f"model.type must be one of {', '.join(MODEL_TYPES)}, got {self.type!r}")
        if self.norm not in NORM_PLACES:
            raise ValueError(f"model.norm must be one of {', '.join(NORM_PLACES)}, got {self.norm!r}")
        if self.type != "gpt" and (self.attention != "manual" or self.score != "dot" or self.norm != "pre"):
            option = ("model.attention=fused" if self.attention != "manual" else f"model.score={self.score}"
                      if self.score != "dot" else f"model.norm={self.norm}")
            raise ValueError(f"{option} means nothing for model.type={self.type}, which has no attention blocks; "
                             f"leave model.attention, model.score and model.norm at their defaults")
        if self.score == "additive" and self.attention == "fused":
            raise ValueError(
                "model.score=additive needs model.attention=manual (the fused kernel only does dot products)")

    def _check_types(self) -> None:
        """Each field of the type it declares, as the config loader checks a YAML file: a model config also comes
        from checkpoints, where `n_layer: 2.5` or `bias: "yes"` would otherwise fail deep inside torch."""
        kinds = {"int": ((int,), "an integer"), "float": ((int, float), "a number"), "bool": ((bool,), "true or false"),
                 "str": ((str,), "a string")}
        for f in fields(self):
            value = getattr(self, f.name)
            allowed, words = kinds[f.type]  # f.type is the annotation's text (annotations are postponed here)
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                shown = repr(value) if isinstance(value, (int, float, str, bool)) else type(value).__name__
                raise ValueError(f"model.{f.name} must be {words}, got {shown[:40]}")

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)
