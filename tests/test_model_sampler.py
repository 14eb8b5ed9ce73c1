"""model.sampler: the fixed-shape window gives the characters of the plain path (a forward pass over the whole
context per character, no cache) for the same seed: greedy and sampled, with top-k and top-p, prompts shorter and
longer than the window, a batch of samples, eager and compiled."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from conftest import needs_cpu_compile
from test_training_kernels import operators_run

from model import GPT, GPTConfig, NonFiniteLogits
from model import sampler as sampler_module
from model.gpt import sample_next
from model.sampler import MIN_FAST_TEMPERATURE, WindowSampler
from sampling.compiling import SAMPLE_CHUNK
from sampling.writing import saved_step
from training import linear_kernel, step_file, window_kernel
from training.compile_cache import COMPILE_OPTIONS
from training.compile_errors import one_line


def peaked_model(n_layer: int) -> GPT:
    torch.manual_seed(0)
    # dropout is off in eval mode; the weights are random but far from uniform, so the draws matter
    m = GPT(GPTConfig(vocab_size=23, block_size=8, n_layer=n_layer, n_head=2, n_embd=16, dropout=0.1)).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(3)  # peaked distributions (the head is tied to the embeddings), as a trained model has
    return m


@pytest.fixture(scope="module")
def model() -> GPT:
    return peaked_model(2)


@pytest.fixture(scope="module")
def one_layer() -> GPT:
    """For the compiled tests: each layer is more code to compile (the sampling loop's, block 8, span 1: 9.4 s for one
    layer against 12.8 s for two, 2-core AMD EPYC (Zen 2, AVX2), 2026-12-06), and one shows what they check."""
    return peaked_model(1)


def plain(model: GPT, prompt: torch.Tensor, n: int, temperature: float, top_k: int | None, top_p: float | None,
          seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT.generate without its cache: the text and the generator's state after it."""
    gen = torch.Generator().manual_seed(seed)
    return model.generate(prompt, n, temperature, top_k, top_p, gen, use_cache=False), gen.get_state()


def windowed(sampler: WindowSampler, prompt: torch.Tensor, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = torch.cat([prompt, *sampler.generate_iter(prompt, n, gen)], dim=1)
    return out, gen.get_state()


SETTINGS = [(0.0, None, None), (0.8, None, None), (1.0, 5, None), (1.3, None, 0.9), (0.7, 4, 0.8), (1e-3, None, None)]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
@pytest.mark.parametrize(("prompt_length", "chunk", "span"),
                         [(1, 1, 1), (5, 1, 1), (13, 1, 1), (1, 3, 1), (13, 3, 1), (1, 4, 2), (13, 6, 3), (5, 8, 8)])
def test_the_window_gives_the_plain_paths_characters(model, temperature, top_k, top_p, prompt_length, chunk, span):
    # chunk 3: 40 characters are 13 calls of 3 and a last one of 1. With a span (model.span) the known rows of `span`
    # windows are computed together: a short prompt fills the window within a pass, a span of 6 ends on a pass of 3
    # for the 4 characters left (2 drawn past them, unread), and a span of block_size leaves the last window one
    # known row.
    prompt = torch.randint(0, 23, (3, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
    expected, expected_state = plain(model, prompt, 40, temperature, top_k, top_p, seed=7)
    sampler = WindowSampler(model, temperature, top_k, top_p, chunk=chunk, span=span)
    assert sampler.steps.span == span
    got, state = windowed(sampler, prompt, 40, seed=7)
    assert torch.equal(got, expected)
    # and it leaves the generator where the plain path does: what is drawn next is the same too
    assert torch.equal(state, expected_state)
    if temperature >= 0.5:  # the draws matter: another seed gives other text
        assert not torch.equal(windowed(WindowSampler(model, temperature, top_k, top_p), prompt, 40, seed=8)[0], got)


@pytest.mark.parametrize("kind", [{}, {"attention": "fused"}, {"score": "additive"}, {"norm": "post"}])
@pytest.mark.parametrize("prompt_length", [1, 20])
def test_the_eager_slide_fills_its_window_in_a_few_shapes_with_the_plain_paths_characters(kind, prompt_length,
                                                                                           monkeypatch):
    # While the window of 40 fills, it runs 16, 32 or 40 rows (SLIDE_ROWS = 16), the characters first and padding
    # after them; once full, 40. A prompt of 20 starts at 32.
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=23, block_size=40, n_layer=2, n_head=2, n_embd=16, **kind)).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(3)
    prompt = torch.randint(0, 23, (2, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
    expected, expected_state = plain(m, prompt, 60, 0.9, None, None, seed=3)
    rows, hidden_at = [], m.hidden_at
    monkeypatch.setattr(m, "hidden_at", lambda idx, *args: rows.append(idx.size(1)) or hidden_at(idx, *args))
    got, state = windowed(WindowSampler(m, 0.9, None, None), prompt, 60, seed=3)
    assert torch.equal(got, expected) and torch.equal(state, expected_state)
    assert sorted(set(rows)) == ([16, 32, 40] if prompt_length == 1 else [32, 40]) and len(rows) == 60


def counted_pass(model: GPT, calls: list[int]) -> sampler_module.WindowPass:
    """The eager sampler's window pass for model (training/window_kernel.py), counting its calls into calls."""
    made = window_kernel.window_pass(model, 3, compiled=False)
    assert made is not None

    def op(*args):
        calls.append(1)
        return made.op(*args)

    return made._replace(op=op)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
@pytest.mark.parametrize(("batch", "prompt_length"), [(1, 1), (3, 5), (1, 13), (3, 13)])
def test_the_eager_slide_with_the_window_pass_gives_the_plain_paths_characters(model, monkeypatch, temperature, top_k,
                                                                                 top_p, batch, prompt_length):
    # sample.py's eager path on a CPU where the kernel applies (TINYCHAR_GEMM=1 here; auto: AMD CPUs): each window's
    # state from the kernel, called from Python, windows of block_size (padded while they fill), a character a call.
    # The same sums in another order (to about 1e-6): no character differs here.
    monkeypatch.setenv("TINYCHAR_GEMM", "1")
    calls: list[int] = []
    prompt = torch.randint(0, 23, (batch, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
    expected, expected_state = plain(model, prompt, 40, temperature, top_k, top_p, seed=7)
    sampler = WindowSampler(model, temperature, top_k, top_p, window_pass=counted_pass(model, calls))
    got, state = windowed(sampler, prompt, 40, seed=7)
    assert torch.equal(got, expected) and torch.equal(state, expected_state)
    assert len(calls) == 40


def test_the_eager_slide_with_the_window_pass_draws_a_few_characters_from_a_short_prompt_in_a_long_window(monkeypatch):
    # 1 + 5 characters in a window of 40: the slide's windows are block_size wide all the same, the kernel's shape
    monkeypatch.setenv("TINYCHAR_GEMM", "1")
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=23, block_size=40, n_layer=2, n_head=2, n_embd=16)).eval()
    calls: list[int] = []
    prompt = torch.tensor([[3]])
    got, state = windowed(WindowSampler(m, 0.9, None, None, window_pass=counted_pass(m, calls)), prompt, 5, seed=2)
    expected, expected_state = plain(m, prompt, 5, 0.9, None, None, seed=2)
    assert torch.equal(got, expected) and torch.equal(state, expected_state) and len(calls) == 5


def test_the_window_pass_of_the_eager_sampler_takes_up_to_sixteen_windows_where_it_applies(model, monkeypatch):
    monkeypatch.setenv("TINYCHAR_GEMM", "1")
    made = window_kernel.window_pass(model, window_kernel.EAGER_MAX_BATCH, compiled=False)
    assert made is not None and made.op is window_kernel.window_hidden_in_python  # through Python, no dispatcher
    assert window_kernel.window_pass(model, window_kernel.EAGER_MAX_BATCH + 1, compiled=False) is None
    assert window_kernel.window_pass(model, 2) is None  # compiled: one window (window_kernel.MAX_BATCH)
    monkeypatch.setenv("TINYCHAR_GEMM", "0")
    assert window_kernel.window_pass(model, 1, compiled=False) is None


@pytest.mark.parametrize("kind", [{}, {"attention": "fused"}, {"score": "additive"}, {"norm": "post"}])
@pytest.mark.parametrize("n_layer", [1, 3])
def test_a_span_gives_the_plain_paths_characters_for_every_kind_of_model(kind, n_layer):
    # one block (the last is the first: its projections looked up) and three; fused and additive attention
    torch.manual_seed(3)
    m = GPT(GPTConfig(vocab_size=11, block_size=6, n_layer=n_layer, n_head=2, n_embd=8, **kind)).eval()
    prompt = torch.randint(0, 11, (2, 4), generator=torch.Generator().manual_seed(2))
    for span, chunk in ((2, 4), (6, 6)):
        got = windowed(WindowSampler(m, 1.0, None, None, chunk=chunk, span=span), prompt, 30, seed=5)[0]
        assert torch.equal(got, plain(m, prompt, 30, 1.0, None, None, seed=5)[0])


def test_a_span_is_a_divisor_of_the_chunk_within_the_window_and_never_in_training_mode_or_a_cuda_graph(model):
    def span(**kwargs):
        return WindowSampler(model, 0.8, None, None, **kwargs).steps.span

    assert span(chunk=32, span=2) == 2
    assert span(chunk=32, span=16) == 8  # at most block_size, 8
    assert span(chunk=6, span=4) == 2  # a divisor of the chunk: 6 is drawn as 3 passes of 2
    assert span(chunk=5, span=2) == 1
    assert span(chunk=4, span=2, graph=True) == 1
    training = copy.deepcopy(model).train()
    assert WindowSampler(training, 0.8, None, None, chunk=4, span=2).steps.span == 1


@pytest.mark.parametrize("kind", [{}, {"attention": "fused"}, {"score": "additive"}, {"norm": "post"}])
@pytest.mark.parametrize(("row", "length"), [(0, 8), (4, 8), (7, 8), (None, 8), (None, 5)])
@pytest.mark.parametrize("n_layer", [1, 2])
@pytest.mark.parametrize("looked_up", [False, True])
def test_hidden_at_is_hiddens_row(kind, row, length, n_layer, looked_up):
    # the last layer computed for one position only gives that position's state of the full forward pass (row None:
    # the last position); so does the first block's projections looked up (with one layer, that block is the last)
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=n_layer, n_head=2, n_embd=16, **kind)).eval()
    idx = torch.randint(0, 11, (3, length))
    with torch.no_grad():
        full, _ = m.hidden(idx)
        at = m.hidden_at(idx, None if row is None else torch.tensor([row]),
                         m.first_projections() if looked_up else None)
    assert at.shape == (3, 16)
    torch.testing.assert_close(at, full[:, -1 if row is None else row], rtol=0, atol=1e-6)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_the_first_projections_are_the_first_blocks_projections_of_each_character_at_each_position(norm):
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=2, n_head=2, n_embd=8, norm=norm)).eval()
    first = m.first_projections()
    assert first.shape == (5, 4, 24) and not first.requires_grad
    block = m.transformer.h[0]
    with torch.no_grad():
        for c, p in [(0, 0), (3, 1), (4, 3)]:
            x = m.transformer.wte.weight[c] + m.transformer.wpe.weight[p]
            projected = block.attn.c_attn(block.ln_1(x) if norm == "pre" else x)  # post-norm: the sum itself
            torch.testing.assert_close(first[c, p], projected, rtol=0, atol=1e-6)


def test_the_sampler_looks_the_first_block_up_in_eval_mode_below_the_size_limit(model, monkeypatch):
    # in eval mode (no dropout on the embeddings), within MAX_FIRST_PROJECTIONS values
    assert torch.equal(WindowSampler(model, 1.0, None, None).first, model.first_projections())
    model.train()
    try:
        assert WindowSampler(model, 1.0, None, None).first is None
    finally:
        model.eval()
    size = model.config.vocab_size * model.config.block_size * 3 * model.config.n_embd
    monkeypatch.setattr(sampler_module, "MAX_FIRST_PROJECTIONS", size)
    assert WindowSampler(model, 1.0, None, None).first is not None
    monkeypatch.setattr(sampler_module, "MAX_FIRST_PROJECTIONS", size - 1)
    assert WindowSampler(model, 1.0, None, None).first is None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_window_of_one_character_gives_the_plain_paths_characters(temperature):
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=23, block_size=1, n_layer=2, n_head=2, n_embd=16)).eval()
    prompt = torch.randint(0, 23, (3, 4), generator=torch.Generator().manual_seed(1))
    expected, expected_state = plain(m, prompt, 25, temperature, None, None, seed=7)
    for chunk in (1, 3):
        got, state = windowed(WindowSampler(m, temperature, None, None, chunk=chunk), prompt, 25, seed=7)
        assert torch.equal(got, expected) and torch.equal(state, expected_state)


@pytest.mark.parametrize("top_p", [1e-46, 5e-324, 1e-6])
def test_the_smallest_top_p_keeps_the_likeliest_character_on_every_path(model, top_p):
    # a top_p under float32's smallest value rounds to 0 where it is compared: once that dropped every character
    # (torch.multinomial raised; the fixed-shape draw took id 0 every time). Any top_p > 0 is the smallest nucleus:
    # the likeliest character alone, greedy decoding, on every path.
    prompt = torch.randint(0, 23, (2, 5), generator=torch.Generator().manual_seed(2))
    greedy = model.generate(prompt, 20, temperature=0.0)
    expected, expected_state = plain(model, prompt, 20, 1.0, None, top_p, seed=4)
    assert torch.equal(expected, greedy)
    cached = model.generate(prompt, 20, 1.0, None, top_p, torch.Generator().manual_seed(4))
    assert torch.equal(cached, greedy)
    for chunk in (1, 3):
        got, state = windowed(WindowSampler(model, 1.0, None, top_p, chunk=chunk), prompt, 20, seed=4)
        assert torch.equal(got, greedy)
        assert torch.equal(state, expected_state)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1e39, 1, None), (1e300, None, 0.01), (1e10, None, 1e-6)])
def test_a_huge_temperature_keeps_top_k_and_top_p_to_the_likeliest_on_every_path(model, temperature, top_k, top_p):
    # the logits divided by it round to equal values (all 0 past float32's range; softmax weights all 1.0 past about
    # 1e8): --top-k 1 drew from every character and --top-p 0.01 always took the same arbitrary one
    prompt = torch.randint(0, 23, (2, 5), generator=torch.Generator().manual_seed(2))
    greedy = model.generate(prompt, 20, temperature=0.0)
    expected, expected_state = plain(model, prompt, 20, temperature, top_k, top_p, seed=4)
    assert torch.equal(expected, greedy)
    assert torch.equal(model.generate(prompt, 20, temperature, top_k, top_p, torch.Generator().manual_seed(4)), greedy)
    for chunk in (1, 3):
        got, state = windowed(WindowSampler(model, temperature, top_k, top_p, chunk=chunk), prompt, 20, seed=4)
        assert torch.equal(got, greedy) and torch.equal(state, expected_state)


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "message"), [
    (-1.0, None, None, "temperature must be a finite number >= 0"),  # was: accepted, the unlikeliest characters
    (float("nan"), None, None, "temperature must be a finite number >= 0"),
    (1.0, 0, None, "top_k must be >= 1"),
    (1.0, None, 0.0, r"top_p must be in \(0, 1\]"),
    (1.0, None, 2.0, r"top_p must be in \(0, 1\]"),
])
def test_the_sampler_refuses_bad_sampling_settings_by_name(model, temperature, top_k, top_p, message):
    with pytest.raises(ValueError, match=message):
        WindowSampler(model, temperature, top_k, top_p)


@pytest.mark.parametrize("chunk", [1, 3])
def test_the_sampler_refuses_a_bad_request_when_called(model, chunk):
    sampler = WindowSampler(model, 1.0, None, None, chunk=chunk)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0, got -2"):
        sampler.generate_iter(torch.tensor([[1, 2]]), -2)
    with pytest.raises(ValueError, match=r"idx must be .* got shape \(2, 0\)"):
        sampler.generate_iter(torch.zeros(2, 0, dtype=torch.long), 3)


def test_a_vanishing_temperature_is_left_to_the_plain_path(model):
    with pytest.raises(ValueError, match="use GPT.generate"):
        WindowSampler(model, MIN_FAST_TEMPERATURE / 10, None, None)


def overflowing_after(model: GPT, prompt: torch.Tensor) -> GPT:
    """A copy of model whose logits are finite after prompt (1, T) but not one character later: a character's
    embedding (tied to its row of the head) set along the prompt's last final state so that its logit there is 1e38,
    drawn for sure at any temperature, and its embedding then overflows float32 in the next window. Not character 0:
    the fixed-shape window pads with it, so there its overflow would show one character sooner."""
    late = copy.deepcopy(model)
    with torch.no_grad():
        state = late.hidden(prompt)[0][0, -1]
        char = next(c for c in range(1, late.config.vocab_size) if c not in prompt[0].tolist())
        late.transformer.wte.weight[char] = state / state.norm() ** 2 * 1e38
    assert torch.isfinite(late(prompt)[0][:, -1]).all()  # what sample.py's probe checks: finite for the prompt
    return late


def drawn_until_overflow(characters) -> list[int]:
    """The ids a sampling iterator yields before it raises NonFiniteLogits (which it must)."""
    got = []
    with pytest.raises(NonFiniteLogits, match="not a finite number"):
        for c in characters:
            got.append(c.tolist())
    return got


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("path", ["cache", "no cache", "slide", "slide with the pass", "chunk of 3", "span of 2",
                                  "unrolled chunk of 4"])
def test_logits_that_overflow_after_the_prompt_stop_every_path_after_the_same_characters(model, temperature, path,
                                                                                         monkeypatch):
    # The fixed-shape paths drew from NaN probabilities without a word (the argmax of NaNs: the vocabulary's first
    # character, or the overflowing one, over and over), as did GPT.generate greedily or without its cache.
    prompt = torch.tensor([[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]])
    late = overflowing_after(model, prompt[:1])
    gen = torch.Generator().manual_seed(1)
    if path in ("cache", "no cache"):
        characters = late.generate_iter(prompt[:1], 10, temperature, None, None, gen, use_cache=path == "cache")
    else:
        chunk = {"slide": 1, "slide with the pass": 1, "chunk of 3": 3, "span of 2": 4, "unrolled chunk of 4": 4}[path]
        monkeypatch.setenv("TINYCHAR_GEMM", "1")
        calls: list[int] = []
        passes = {"window_pass": counted_pass(late, calls)} if path == "slide with the pass" else {}
        sampler = WindowSampler(late, temperature, None, None, chunk=chunk, graph=path.startswith("unrolled"),
                                span=2 if path == "span of 2" else 1, **passes)
        characters = sampler.generate_iter(prompt[:1], 10, gen)
    assert len(drawn_until_overflow(characters)) == 1  # the overflowing character itself, then the error
    if path == "slide with the pass":
        assert len(calls) == 2
    # in a batch, one row's overflow stops them all, at the same character
    sampler = WindowSampler(late, temperature, None, None, chunk=3)
    assert len(drawn_until_overflow(sampler.generate_iter(prompt, 10, torch.Generator().manual_seed(1)))) == 1


@pytest.mark.parametrize("path", ["slide", "slide with the pass", "chunk of 3", "span of 2", "unrolled chunk of 4"])
def test_logits_that_overflow_only_once_divided_by_the_temperature_are_greedy_on_every_path(model, path, monkeypatch):
    # Finite logits near float32's limit (1e36; sample.py's probe passes them) over a temperature of 1e-3 overflow:
    # the eager slide raised torch.multinomial's RuntimeError (sample.py's default path, a traceback) and the
    # fixed-shape window drew id 0 every time, where GPT.generate decodes greedily.
    loud = copy.deepcopy(model)
    with torch.no_grad():
        loud.transformer.ln_f.weight.mul_(1e37)
    prompt = torch.tensor([[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]])
    logits = loud(prompt)[0][:, -1]
    assert torch.isfinite(logits).all() and not torch.isfinite(logits / 1e-3).all()
    greedy = loud.generate(prompt, 12, temperature=0.0)
    expected, expected_state = plain(loud, prompt, 12, 1e-3, None, None, seed=4)
    assert torch.equal(expected, greedy)
    chunk = {"slide": 1, "slide with the pass": 1, "chunk of 3": 3, "span of 2": 4, "unrolled chunk of 4": 4}[path]
    monkeypatch.setenv("TINYCHAR_GEMM", "1")
    calls: list[int] = []
    passes = {"window_pass": counted_pass(loud, calls)} if path == "slide with the pass" else {}
    sampler = WindowSampler(loud, 1e-3, None, None, chunk=chunk, graph=path.startswith("unrolled"),
                            span=2 if path == "span of 2" else 1, **passes)
    got, state = windowed(sampler, prompt, 12, seed=4)
    assert len(calls) == (12 if passes else 0)
    assert torch.equal(got, greedy)
    assert torch.equal(state, expected_state)  # each character's draw taken, as the window takes it ahead


def test_a_row_whose_unlikely_characters_alone_fall_to_minus_infinity_is_still_drawn_from():
    # -3e38 / 0.5 is -inf, which the softmax takes as a probability of 0: the row's other characters are as likely as
    # ever, but the row was made greedy (the second row, whose largest value overflows, is)
    logits = torch.tensor([[-3e38, 0.0, 0.1], [3e38, 0.0, 0.1]])
    drawn = torch.cat([sample_next(logits, 0.5, generator=torch.Generator().manual_seed(seed)) for seed in range(40)],
                      dim=1)
    assert set(drawn[0].tolist()) == {1, 2}
    assert set(drawn[1].tolist()) == {0}


@needs_cpu_compile
@pytest.mark.slow
@pytest.mark.parametrize(("span", "gemm"), [(1, "0"), (2, "1"), (1, "pass")])
def test_the_compiled_window_gives_the_plain_paths_characters_and_so_does_its_saved_step(one_layer, tmp_path,
                                                                                          monkeypatch, span, gemm):
    # Compiled code fuses and reorders float32 sums, so its logits may differ from eager ones in the last bits; a
    # character could differ only where two candidates tie to ~1e-7. Measured on 2,000 characters of a block-8
    # model and 400 of a block-64 one: identical. Here: 300 characters (9 calls of the loop over 32 and one of 12),
    # a batch of 2, prompt past the window. Compiled as sample.py compiles on a CPU: the step saved whole
    # (training.step_file), then loaded as a later run loads it; with a span of 2, with the linear layers' products
    # from their weights packed (training.linear_kernel.attach_packed, TINYCHAR_GEMM=1: sample.py's on AMD without
    # AVX-512), on a copy of the model; or with the window's pass as one kernel (training.window_kernel, sample.py's
    # where it applies, on the same CPUs).
    monkeypatch.setattr(step_file, "step_path", lambda name: tmp_path / f"tinychar-step-{name}.pt2")
    monkeypatch.setattr(step_file, "_STEPS", {})
    monkeypatch.setenv("TINYCHAR_GEMM", "1" if gemm == "pass" else gemm)
    if gemm == "1":
        one_layer = copy.deepcopy(one_layer)
        assert linear_kernel.attach_packed(one_layer)
    passes = {"window_pass": window_kernel.window_pass(one_layer)} if gemm == "pass" else {}
    assert passes.get("window_pass", True) is not None
    source: list[str] = []
    ahead = saved_step(torch.device("cpu"), source) if step_file.AHEAD else None
    prompt = torch.randint(0, 23, (2, 11), generator=torch.Generator().manual_seed(1))
    sampler = WindowSampler(one_layer, 0.9, 6, None, compile=True, options=COMPILE_OPTIONS, chunk=SAMPLE_CHUNK,
                            ahead=ahead, span=span, **passes)
    try:
        sampler.warm_up(2, torch.device("cpu"))  # as sample.py compiles
    except torch._inductor.exc.InductorError as e:
        # torch 2.11's inductor cannot compile this loop (an index out of bounds in its C++ wrapper's memory planner;
        # without that wrapper, C++ that does not build): sample.py then says so and samples eagerly, the same
        # characters (checked by hand with torch 2.11.0, 2026-11-27). The torch we test on (2.13) must compile it.
        if tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13):  # a 2.13 nightly too
            raise
        pytest.skip(f"torch {torch.__version__}'s inductor cannot compile the sampling loop ({one_line(e)})")
    if step_file.AHEAD:  # (every torch we test on: 2.13 has it)
        assert source == ["compiled"] and len(list(tmp_path.glob("tinychar-step-*.pt2"))) == 1
        monkeypatch.setattr(step_file, "_STEPS", {})  # as a later process finds it
        loaded = WindowSampler(one_layer, 0.9, 6, None, compile=True, options=COMPILE_OPTIONS, chunk=SAMPLE_CHUNK,
                               ahead=ahead, span=span, **passes)
        loaded.warm_up(2, torch.device("cpu"))
        assert source == ["compiled", "loaded"]
        assert torch.equal(windowed(loaded, prompt, 300, seed=3)[0], plain(one_layer, prompt, 300, 0.9, 6, None, 3)[0])
        if gemm != "0":  # a model of the same shape, other weights packed: the saved step reads them, none of its own
            other = copy.deepcopy(one_layer)
            with torch.no_grad():
                other.transformer.h[0].mlp.c_fc.weight.mul_(3)
            if gemm == "1":
                assert linear_kernel.attach_packed(other)
            theirs_pass = {"window_pass": window_kernel.window_pass(other)} if gemm == "pass" else {}
            monkeypatch.setattr(step_file, "_STEPS", {})
            theirs = WindowSampler(other, 0.9, 6, None, compile=True, options=COMPILE_OPTIONS, chunk=SAMPLE_CHUNK,
                                   ahead=ahead, span=span, **theirs_pass)
            theirs.warm_up(2, torch.device("cpu"))
            assert source == ["compiled", "loaded", "loaded"]
            got, expected = windowed(theirs, prompt, 300, seed=3)[0], plain(other, prompt, 300, 0.9, 6, None, 3)[0]
            assert torch.equal(got, expected)
            assert not torch.equal(expected, plain(one_layer, prompt, 300, 0.9, 6, None, 3)[0])
    with torch.profiler.profile() as profile:
        got, state = windowed(sampler, prompt, 300, seed=3)
    expected, expected_state = plain(one_layer, prompt, 300, 0.9, 6, None, seed=3)
    assert torch.equal(got, expected)
    assert torch.equal(state, expected_state)
    assert ("linear_packed" in operators_run(profile)) == (gemm == "1")
    assert ("window_hidden" in operators_run(profile)) == (gemm == "pass")
    # a short prompt: the window fills inside the compiled loop
    got, _ = windowed(sampler, prompt[:, :2], 50, seed=4)
    assert torch.equal(got, plain(one_layer, prompt[:, :2], 50, 0.9, 6, None, seed=4)[0])
    # Logits that overflow after the prompt stop the compiled loop too: the same compiled code (not compiled again, 15
    # s), on the weights changed in place and the first block's table made again from them, then both put back.
    window = prompt[:, -8:]  # a batch of 2, as compiled: one row's overflow stops both
    late = overflowing_after(one_layer, window[:1])
    # (The window pass's weights are packed: its buffer is made again from the weights changed too.)
    wte, first, packed = one_layer.transformer.wte.weight, sampler.first, sampler.steps.pass_weights
    kept = wte.clone(), first.clone(), None if packed is None else packed.clone()
    try:
        with torch.no_grad():
            wte.copy_(late.transformer.wte.weight)
            first.copy_(one_layer.first_projections())
            if packed is not None:
                packed.copy_(window_kernel.pack_weights(one_layer))
        assert len(drawn_until_overflow(sampler.generate_iter(window, 40, torch.Generator()))) == 1
    finally:
        with torch.no_grad():
            wte.copy_(kept[0])
            first.copy_(kept[1])
            if packed is not None:
                packed.copy_(kept[2])


def test_the_step_compiled_ahead_is_asked_for_once_per_shape_and_torch_compiles_where_there_is_none(model,
                                                                                                    monkeypatch):
    # WindowSampler's ahead (sample.py's: the step saved whole) gets run_steps and arguments of the shapes it will
    # be called with, and what it gives checks nothing: a batch of another size asks for another. Where it gives
    # None, torch.compile's own step takes over. Here nothing compiles: "compiled" means run eagerly.
    asked: list[tuple[int, ...]] = []

    def ahead(fn, args):
        steps, window, n, wanted, noise = args
        assert fn is sampler_module.run_steps and isinstance(steps, sampler_module.WindowSteps)
        asked.append(tuple(window.shape))
        return None if window.size(0) == 1 else fn

    compiled: list[object] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append(fn) or fn)
    sampler = WindowSampler(model, 0.8, None, 0.9, compile=True, chunk=3, ahead=ahead)
    prompt = torch.randint(0, 23, (3, 5), generator=torch.Generator().manual_seed(5))
    for rows in (3, 3, 1, 1):
        got, state = windowed(sampler, prompt[:rows], 20, seed=rows)
        expected, expected_state = plain(model, prompt[:rows], 20, 0.8, None, 0.9, seed=rows)
        assert torch.equal(got, expected) and torch.equal(state, expected_state)
    assert asked == [(3, 8), (1, 8)] and compiled == [sampler.steps.forward]
    # the graph path and a model that trains (dropout) compile with torch.compile alone
    assert WindowSampler(model, 0.8, None, None, compile=True, graph=True, ahead=ahead).ahead is None
    training = copy.deepcopy(model).train()
    assert WindowSampler(training, 0.8, None, None, compile=True, ahead=ahead).ahead is None
    assert asked == [(3, 8), (1, 8)]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS[:5])
@pytest.mark.parametrize(("prompt_length", "chunk", "n"), [(1, 1, 40), (13, 3, 40), (5, 16, 40), (2, 64, 10)])
def test_the_unrolled_chunk_gives_the_plain_paths_characters(model, temperature, top_k, top_p, prompt_length, chunk,
                                                             n):
    # graph=True: what a CUDA graph replays, run here uncaptured. The window stays in the runner's buffers from one
    # call to the next; a last, short chunk computes characters nobody reads, and must not move the generator (chunk
    # 16: 40 characters are two calls of 16 and one of which 8 are read; chunk 64: one call, 10 read).
    prompt = torch.randint(0, 23, (3, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
    sampler = WindowSampler(model, temperature, top_k, top_p, chunk=chunk, graph=True)
    for seed in (7, 9):  # the same runner twice: each text starts from its own prompt, not the last text's window
        expected, expected_state = plain(model, prompt, n, temperature, top_k, top_p, seed=seed)
        got, state = windowed(sampler, prompt, n, seed=seed)
        assert torch.equal(got, expected)
        assert torch.equal(state, expected_state)
    assert sampler.unrolled is not None and sampler.unrolled.graph is None  # on a CPU nothing is captured
    # another batch size makes another runner
    got, _ = windowed(sampler, prompt[:1], n, seed=7)
    assert torch.equal(got, plain(model, prompt[:1], n, temperature, top_k, top_p, seed=7)[0])
    assert sampler.unrolled.window.size(0) == 1


@pytest.mark.parametrize(("chunk", "graph"), [(1, False), (4, False), (4, True)])
def test_between_characters_the_callers_code_runs_outside_inference_mode(model, chunk, graph):
    # The sampler draws in inference mode, and hands each character out with the caller's own mode back: a tensor the
    # caller makes between characters is an ordinary one, which autograd can record
    sampler = WindowSampler(model, 0.8, None, None, chunk=chunk, graph=graph)
    prompt = torch.tensor([[1, 2, 3]])
    seen, got = [], []
    for ids in sampler.generate_iter(prompt, 10, torch.Generator().manual_seed(3)):
        seen.append(torch.is_inference_mode_enabled())
        assert not torch.ones(1).is_inference()
        assert ids.shape == (1, 1)
        got.append(ids)
    assert seen == [False] * 10
    assert torch.equal(torch.cat([prompt, *got], dim=1), plain(model, prompt, 10, 0.8, None, None, seed=3)[0])
    # and a caller that is in inference mode stays in it
    with torch.inference_mode():
        assert all(torch.is_inference_mode_enabled() for _ in sampler.generate_iter(prompt, 5, torch.Generator()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
@pytest.mark.parametrize("compiled", [False, True])
def test_the_cuda_graph_gives_the_plain_paths_characters(model, compiled):
    cuda = torch.device("cuda")
    m = GPT(model.config).to(cuda).eval()
    m.load_state_dict(model.state_dict())
    prompt = torch.randint(0, 23, (2, 11), generator=torch.Generator().manual_seed(1)).to(cuda)
    sampler = WindowSampler(m, 0.9, 6, None, compile=compiled, chunk=16, graph=True)
    sampler.warm_up(2, cuda)
    assert sampler.unrolled.graph is not None
    gen = torch.Generator(cuda).manual_seed(3)
    got = torch.cat([prompt, *sampler.generate_iter(prompt, 300, gen)], dim=1)
    expected_gen = torch.Generator(cuda).manual_seed(3)
    expected = m.generate(prompt, 300, 0.9, 6, None, expected_gen, use_cache=False)
    assert torch.equal(got, expected)
    assert torch.equal(gen.get_state(), expected_gen.get_state())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_freeing_one_samplers_graph_leaves_anothers_whole(model):
    """Each sampler captures on a stream of its own: freeing one graph frees the cuBLAS workspace of its stream only
    (PyTorch issue #193402), so a second sampler's graph, captured after it, goes on giving the plain path's text."""
    cuda = torch.device("cuda")
    m = GPT(model.config).to(cuda).eval()
    m.load_state_dict(model.state_dict())
    prompt = torch.randint(0, 23, (2, 11), generator=torch.Generator().manual_seed(1)).to(cuda)
    first = WindowSampler(m, 0.9, 6, None, chunk=16, graph=True)
    first.warm_up(2, cuda)
    second = WindowSampler(m, 0.9, 6, None, chunk=16, graph=True)
    second.warm_up(2, cuda)
    assert first.unrolled.stream is not None and first.unrolled.stream != second.unrolled.stream
    del first
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    taken = [torch.full((1 << 20,), 7.0, device=cuda) for _ in range(64)]  # what was freed, in use again
    gen = torch.Generator(cuda).manual_seed(3)
    got = torch.cat([prompt, *second.generate_iter(prompt, 300, gen)], dim=1)
    expected = m.generate(prompt, 300, 0.9, 6, None, torch.Generator(cuda).manual_seed(3), use_cache=False)
    assert torch.equal(got, expected)
    assert all(bool((t == 7.0).all()) for t in taken)
