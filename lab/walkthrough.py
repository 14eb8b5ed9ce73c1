"""The notes' worked example, printed step by step: ``python -m lab notes``.

Six 3-number embeddings of "Your journey starts with one step" go through each stage of attention the notes build
up, computed by ``lab.notes`` (whose masked steps run the GPT's own ``masked_attention``): the scores of one query,
the ways to turn them into weights, the context vector, every query at once, trainable query, key and value
matrices, the compact classes, the causal mask both ways, dropout, and the multi-head modules. Each stage names the
notebook cell that printed the same numbers (``000``/``001`` are the notes' first two notebooks) and the seed it
draws its weights with, so a reader can put the two side by side. ``--query N`` follows another word. The last two
stages are the later notes' (``lab.notes_modules``): the fifth note's single head on random tokens and what its
scaling does, and the fourth note's modules with keys and values of different widths under a padding mask.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

if not __package__:  # run as a file (python lab/walkthrough.py): the project's packages are one folder up
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # python lab/walkthrough.py, python -m lab.walkthrough: started as python -m lab notes is,
    # before torch loads (a Ctrl-C while it loaded was a traceback; stdout was not made to take any text)
    from training.interpreter import refuse_old_python  # reads only sys and os, on any Python that parses this

    refuse_old_python(__file__)  # before the imports, which fail on a Python older than tinychar needs
    from lab.__main__ import main as lab_main

    raise SystemExit(lab_main(["notes", *sys.argv[1:]]))

import torch

from configs.userinput import OneLineParser
from lab import output_failed
from lab.notes import (
    WORDS,
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
    attention_scores_for_query,
    causal_mask,
    causal_softmax_attention,
    context_vector,
    copy_v2_weights_into_v1,
    drop_attention_weights,
    journey_inputs,
    normalise_by_sum,
    renormalised_causal_weights,
    simple_self_attention,
    softmax_naive,
    trainable_attention_for_query,
    v2_as_built_in_001,
)
from lab.notes_modules import MultiHeadAttention as NotesMultiHeadAttention
from lab.notes_modules import ScaledDotProductAttention, single_head
from model.config import short_int
from training.signals import Interrupted, InterruptSignals

WIDTH = 9  # one printed number: sign, digits and 4 decimals, right-aligned, with room for -inf


def number(x: float) -> str:
    return f"{x:>{WIDTH}.4f}" if x == x and abs(x) != float("inf") else f"{x:>{WIDTH}}"


def row(label: str, values: Sequence[float]) -> str:
    return f"  {label:<8}" + "".join(number(float(v)) for v in values)


def table(matrix: torch.Tensor, labels: Sequence[str], columns: Sequence[str] | None = None) -> list[str]:
    """A matrix as rows of 4-decimal numbers, each row named, the columns named above when given."""
    head = [f"  {'':<8}" + "".join(f"{c:>{WIDTH}}" for c in columns)] if columns is not None else []
    return head + [row(label, values) for label, values in zip(labels, matrix.tolist(), strict=True)]


def short(word: str) -> str:
    return word if len(word) <= WIDTH - 1 else word[: WIDTH - 2] + "."


def section(title: str, *lines: str) -> list[str]:
    return ["", title, "-" * len(title), *lines]


def walkthrough(query: int) -> str:
    """The whole text, query counted from 1 as the notes count x^1..x^6."""
    x = journey_inputs()
    words = [short(w) for w in WORDS]
    dims = [f"d{k + 1}" for k in range(x.size(1))]
    out = [f'The notes\' worked example, "{" ".join(WORDS)}", computed by tinychar\'s attention code '
           f"(lab/notes.py); the query is x^{query} ({WORDS[query - 1]})."]
    if query != 2:
        out.append("The notes follow x^2 (journey), so sections 2 and 4 name their cells for it alone; the other "
                   "sections are the same for every query.")
    out += section("1. The inputs: one embedding of 3 numbers a word (001 In[1])", *table(x, words, dims))
    out += _one_query(x, query, words, dims)
    every = simple_self_attention(x)
    out += section("3. Every query at once: scores X X^T, softmax along each row, weights @ X (000 In[39]-In[51])",
                   "   scores:", *table(every.scores, words, words),
                   "   weights (each row sums to 1):", *table(every.weights, words, words),
                   "   context vectors:", *table(every.context, [f"z^{k + 1}" for k in range(len(WORDS))], dims))
    out += _trainable(x, query, words)
    out += _compact_classes(x, query, words)
    masked, causal = _causal(x, every.weights, words)
    out += causal
    torch.manual_seed(123)
    dropped = drop_attention_weights(masked, 0.5)
    out += section(
        "7. Dropout on the attention weights, p = 0.5, torch.manual_seed(123) (in training only; no notes' numbers)",
        *table(dropped, words, words),
        "   About half the weights are zeroed and the rest doubled (1 / (1 - p)), so each keeps its expected value.")
    out += _modules(x, words)
    out += _single_head()
    out += _notes_modules(x, words)
    return "\n".join(out) + "\n"


def _cells(query: int, which: str) -> str:
    """The notes' cells that print a section's numbers: they follow x^2, and print these numbers for it alone."""
    return f" ({which})" if query == 2 else ""


def _one_query(x: torch.Tensor, query: int, words: list[str], dims: list[str]) -> list[str]:
    """Section 2: one query's scores, three ways to weights, and its context vector."""
    scores = attention_scores_for_query(x, x[query - 1])
    by_sum, naive, soft = normalise_by_sum(scores), softmax_naive(scores), torch.softmax(scores, dim=0)
    return section(
        f"2. The scores of x^{query} against every input, the dot products x^i . x^{query}"
        f"{_cells(query, '001 In[18]')}",
        *table(scores[None], ["score"], words),
        "", f"   Three ways to turn them into weights that sum to 1{_cells(query, '001 In[19]-In[21]')}:",
        *table(torch.stack([by_sum, naive, soft]), ["/ sum", "exp/sum", "softmax"], words),
        "   Divided by their sum, a negative score would stay negative; softmax makes every weight positive,",
        "   and torch.softmax subtracts the largest score first so that exp cannot overflow (the same numbers",
        "   where both are finite).",
        "", f"   The context vector z^{query} = sum of weight_i * x^i, the inputs mixed by the weights"
            f"{_cells(query, '000 In[38]')}:",
        *table(context_vector(soft, x)[None], [f"z^{query}"], dims))


def _trainable(x: torch.Tensor, query: int, words: list[str]) -> list[str]:
    """Section 4: one query through trainable projections, scaled."""
    torch.manual_seed(123)
    W_query, W_key, W_value = (torch.rand(x.size(1), 2) for _ in range(3))
    step = trainable_attention_for_query(x[query - 1], x, W_query, W_key, W_value)
    return section(
        "4. Trainable weights: torch.manual_seed(123), then W_query, W_key, W_value = torch.rand(3, 2)"
        + _cells(query, "000 In[60]-In[71]"),
        *table(step.query[None], [f"q^{query}"], ["q1", "q2"]),
        "   scores q . k^i, then weights softmax(score / sqrt(d_k)), d_k = 2:",
        *table(torch.stack([step.scores, step.weights]), ["score", "weight"], words),
        *table(step.context[None], [f"z^{query}"], ["z1", "z2"]),
        "   Scaling by 1/sqrt(d_k) keeps large dot products from pushing softmax towards one-hot weights, whose",
        "   gradients vanish: it is the \"scaled\" of scaled dot-product attention.")


def _compact_classes(x: torch.Tensor, query: int, words: list[str]) -> list[str]:
    """Section 5: SelfAttention_v1 and _v2, and exercise 3.1."""
    torch.manual_seed(123)
    v1 = SelfAttention_v1(3, 2)
    torch.manual_seed(789)
    v2 = SelfAttention_v2(3, 2)
    torch.manual_seed(789)
    copied, source = SelfAttention_v1(3, 2), SelfAttention_v2(3, 2)
    copy_v2_weights_into_v1(copied, source)
    with torch.no_grad():
        both = torch.cat([copied(x), source(x)], dim=1)
        return section(
            "5. The compact classes, each row a context vector (000 In[114], In[124], In[128])",
            f"   SelfAttention_v1(3, 2) after torch.manual_seed(123): its row {query} is section 4's z^{query}",
            *table(v1(x), words, ["z1", "z2"]),
            "   SelfAttention_v2(3, 2) after torch.manual_seed(789) (nn.Linear's initialisation, other numbers):",
            *table(v2(x), words, ["z1", "z2"]),
            "   exercise 3.1, after torch.manual_seed(789): v1 given v2's weights transposed, then v2, side by side:",
            *table(both, words, ["v1 z1", "v1 z2", "v2 z1", "v2 z2"]))


def _causal(x: torch.Tensor, weights_of_every: torch.Tensor, words: list[str]) -> tuple[torch.Tensor, list[str]]:
    """Section 6: the causal mask, both ways, and applied to section 3's weights (weights_of_every); the masked
    weights (for section 7) and the section."""
    sa = v2_as_built_in_001()
    with torch.no_grad():
        queries, keys, values = sa.W_query(x), sa.W_key(x), sa.W_value(x)
        raw = queries @ keys.T
        scaled = raw / keys.size(-1) ** 0.5
        weights = torch.softmax(scaled, dim=-1)
        context, masked = causal_softmax_attention(scaled, values)
    return masked, section(
        "6. The causal mask: a position sees itself and the past, never the future (001 In[59]-In[64])",
        "   001's SelfAttention_v2 after torch.manual_seed(123), its layers built key, value, query; its weights:",
        *table(weights, words, words),
        "   the mask, 1 where a query (row) may look at a key (column):",
        *table(causal_mask(len(WORDS)).float(), words, words),
        "   way (a), the weights times the mask, each row divided by its new sum:",
        *table(renormalised_causal_weights(weights), words, words),
        "   way (b), what the GPT runs: the scores above the diagonal set to -inf, then softmax(scores / sqrt(d_k)):",
        *table(raw.masked_fill(~causal_mask(len(WORDS)), float("-inf")), words, words),
        *table(masked, words, words),
        "   The two ways agree: softmax over the visible scores is the renormalisation of way (a).",
        "   001 In[61]-In[62] applied way (a) to section 3's weights:",
        *table(renormalised_causal_weights(weights_of_every), words, words),
        "   The causal context vectors, weights @ values (not printed in the notes):",
        *table(context, words, ["z1", "z2"]))


def _modules(x: torch.Tensor, words: list[str]) -> list[str]:
    """Section 8: the notes' attention modules on a batch."""
    batch = torch.stack([x, x])  # (2, 6, 3): two copies, as the notes batch them
    with torch.no_grad():
        torch.manual_seed(123)
        head = CausalAttention(3, 2, context_length=len(WORDS), dropout=0.0).eval()(batch)
        torch.manual_seed(123)
        wrapped = MultiHeadAttentionWrapper(3, 2, len(WORDS), 0.0, num_heads=2).eval()(batch)
        torch.manual_seed(123)
        fused = MultiHeadAttention(3, 2, len(WORDS), 0.0, num_heads=2).eval()(batch)
    return section(
        "8. The modules on a batch of two copies of the sentence, each after torch.manual_seed(123) "
        "(no notes' numbers)",
        "   CausalAttention(3, 2): one head, (2, 6, 3) -> (2, 6, 2); the first copy:",
        *table(head[0], words, ["z1", "z2"]),
        "   MultiHeadAttentionWrapper(3, 2, num_heads=2): two heads side by side -> (2, 6, 4):",
        *table(wrapped[0], words, ["h1 z1", "h1 z2", "h2 z1", "h2 z2"]),
        "   MultiHeadAttention(3, 2, num_heads=2): one projection split into 2 heads of 1, then W^O -> (2, 6, 2):",
        *table(fused[0], words, ["z1", "z2"]),
        "", "The GPT (model/attention.py) runs section 6's way (b) in every head of every block, with the heads of",
        "section 8's MultiHeadAttention; `python sample.py --attention-map FILE` draws its weights.")


def _single_head() -> list[str]:
    """Section 9: the fifth note's head on random tokens, and the variance its scaling keeps."""
    torch.manual_seed(1337)
    x = torch.randn(4, 8, 32)
    head = single_head(x, head_size=16, seed=1337)  # its layers drawn next, from the same generator
    tokens = [f"t{k + 1}" for k in range(8)]
    return section(
        "9. One head on a batch (004): x = torch.randn(4, 8, 32) after torch.manual_seed(1337), head_size 16",
        "   then key, query, value = nn.Linear(32, 16, bias=False) in that order;",
        "   wei = softmax(masked q k^T / sqrt(16)), out = wei @ v, (4, 8, 16).",
        "   The first sequence's weights, row t the t-th token's, the future zero:",
        *table(head.weights[0], tokens, tokens),
        "   Why the scaling: for q and k of unit variance (1,000 random sequences of them), q k^T has variance about",
        f"   head_size ({head.variance_unscaled:.2f}) and q k^T / sqrt(head_size) about 1 "
        f"({head.variance_scaled:.2f}): the softmax stays diffuse.",
        f"   The largest of the last row's 8 weights is {head.peak_scaled:.2f} on average with the scaling and "
        f"{head.peak_unscaled:.2f} without,",
        "   where the softmax nears one-hot and passes on little gradient.")


def _notes_modules(x: torch.Tensor, words: list[str]) -> list[str]:
    """Section 10: the fourth note's modules, their shapes, and the padding mask on the sentence."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 4, 64), torch.randn(2, 8, 6, 64), torch.randn(2, 8, 6, 64)
    out, weights = ScaledDotProductAttention(temperature=64**0.5).eval()(q, k, v)
    mha = NotesMultiHeadAttention(8, 512, 64, 64).eval()
    seq = torch.randn(2, 10, 512)
    with torch.no_grad():
        mha_out, mha_weights = mha(seq, seq, seq)
        torch.manual_seed(123)
        small = NotesMultiHeadAttention(n_head=2, d_model=3, d_k=2, d_v=1, dropout=0.0).eval()
        keys = torch.tensor([[True] * 4 + [False] * 2])  # "one step" taken as padding
        _, padded = small(x[None], x[None], x[None], keys[:, None, :])
    return section(
        "10. The fourth note's modules (003): ScaledDotProductAttention and MultiHeadAttention(n_head, d_model, "
        "d_k, d_v)",
        "   shapes as the note prints them, for random q, k, v after torch.manual_seed(0):",
        f"   ScaledDotProductAttention(sqrt(64)): q {tuple(q.shape)}, k and v {tuple(k.shape)}",
        f"     -> output {tuple(out.shape)}, weights {tuple(weights.shape)}",
        f"   MultiHeadAttention(8, 512, 64, 64): q = k = v {tuple(seq.shape)}",
        f"     -> output {tuple(mha_out.shape)}, weights {tuple(mha_weights.shape)}",
        "   MultiHeadAttention(n_head=2, d_model=3, d_k=2, d_v=1) after torch.manual_seed(123), on the sentence, with",
        "   the padding mask hiding \"one step\" as if it were padding (mask (1, 1, 6)): head 1's weights, those",
        "   columns zero in every row; keys and queries 2 wide, values 1 wide, the heads' values concatenated (2)",
        "   and projected back to d_model = 3, then Add & Norm: LayerNorm(x + output).",
        *table(padded[0, 0], words, words))


def parser() -> OneLineParser:
    p = OneLineParser(prog="python -m lab notes", description=__doc__.split("\n\n")[0])
    p.add_argument("--query", type=int, default=2,
                   help=f"which word to follow in sections 2 and 4, 1-{len(WORDS)} (default 2: journey)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not 1 <= args.query <= len(WORDS):
        p.error(f"--query must be from 1 to {len(WORDS)} (the words of \"{' '.join(WORDS)}\"), got "
                f"{short_int(args.query)}")
    if sys.stdout is None:  # started with stdout closed (`>&-`)
        p.error("stdout is closed, and the walk-through is written there; redirect it to a file (> notes.txt)")
    try:
        with InterruptSignals():  # SIGTERM as well as Ctrl-C: it ended the command without a word
            sys.stdout.write(walkthrough(args.query))
            sys.stdout.flush()  # here, where a full disk is one line, not at exit in a traceback
        return 0
    except (KeyboardInterrupt, Interrupted) as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"\ninterrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
    except OSError as e:
        return output_failed(e)
