"""training/window_kernel.py: the compiled sampler's pass over its window as one kernel gives GPT.hidden_at's state (to
float32 rounding) and, in the sampler, the plain path's characters; it applies only where it computes the same."""

from __future__ import annotations

import copy

import pytest
import torch
from test_model_sampler import SETTINGS, drawn_until_overflow, overflowing_after, plain, windowed

from model import GPT, GPTConfig
from model.sampler import WindowSampler, WindowSteps
from training import window_kernel


@pytest.fixture(autouse=True)
def kernel_wanted(monkeypatch):
    """The kernel wherever it can run (TINYCHAR_GEMM=1), not only on the CPUs where auto takes it."""
    monkeypatch.setenv("TINYCHAR_GEMM", "1")


def built() -> bool:
    try:
        window_kernel.library()
    except (OSError, window_kernel.subprocess.SubprocessError):
        return False
    return True


needs_kernel = pytest.mark.skipif(not built(), reason="needs a C compiler with OpenMP (the kernel cannot be built)")


def gpt(n_embd: int, n_head: int, bias: bool, block_size: int = 16, n_layer: int = 3, vocab_size: int = 23,
        scale: float = 0.2) -> GPT:
    """A model whose weights are far from their small initial values, so each layer's arithmetic shows."""
    torch.manual_seed(n_embd + n_head + bias)
    m = GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                      bias=bias)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, scale)
        for block in m.transformer.h:
            block.ln_1.weight.add_(1.0)
            block.ln_2.weight.add_(1.0)
    return m


def state(m: GPT, window: torch.Tensor, n: int, first: bool) -> torch.Tensor:
    """The kernel's state of window's rows holding n characters each (through the operator)."""
    made = window_kernel.window_pass(m)
    assert made is not None
    table = m.first_projections() if first else torch.empty(0)
    cfg = m.config
    return made.op(window, torch.tensor([n]), table, made.weights, cfg.vocab_size, cfg.n_embd, cfg.n_head, cfg.n_layer,
                   cfg.bias)


@needs_kernel
@pytest.mark.parametrize(("n_embd", "n_head"), [(16, 2), (32, 2), (64, 4), (48, 3)], ids=["head8", "head16", "4x16",
                                                                                          "3x16"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_gives_hidden_ats_state(n_embd, n_head, bias, first, threads):
    # Head sizes of 8 take the attention a row at a time, 16 and more a head at a time through the tiles; every count
    # of characters from 1 to the whole window (the tiles' last rows and the keys' last panel partly filled); three
    # rows; the first block from the table or computed; on one thread and two (their shares of rows, panels, heads).
    m = gpt(n_embd, n_head, bias)
    kept = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in range(1, 17):
            window = torch.randint(0, 23, (3, 16), generator=torch.Generator().manual_seed(n))
            expected = m.hidden_at(window[:, :n], torch.tensor([n - 1]))
            got = state(m, window, n, first)
            assert got.shape == expected.shape and got.dtype == torch.float32
            # the same arithmetic in another order of additions: float32 rounding apart (measured up to 1.1e-6 on
            # states of about 1, the CPU config's model in float32)
            assert torch.allclose(got, expected, rtol=0, atol=3e-6), (n, (got - expected).abs().max())
    finally:
        torch.set_num_threads(kept)


@needs_kernel
def test_the_kernels_python_and_cpp_calls_agree_and_refuse_a_window_out_of_range():
    m = gpt(32, 2, True)
    made = window_kernel.window_pass(m)
    window = torch.randint(0, 23, (2, 16), generator=torch.Generator().manual_seed(0))
    args = (torch.empty(0), made.weights, 23, 32, 2, 3, True)
    assert torch.equal(made.op(window, torch.tensor([9]), *args),
                       window_kernel.window_hidden_in_python(window, torch.tensor([9]), *args))
    bad = window.clone()
    bad[1, 4] = 23  # a character past the vocabulary, inside the n characters read
    for call in (made.op, window_kernel.window_hidden_in_python):
        with pytest.raises((RuntimeError, ValueError), match="out of range"):
            call(bad, torch.tensor([9]), *args)
        with pytest.raises((RuntimeError, ValueError), match="out of range"):
            call(window, torch.tensor([17]), *args)
    short = (torch.empty(0), made.weights[:-1], *args[2:])  # weights or a table of another model's shape
    table = (torch.zeros(5), *args[1:])
    for call in (made.op, window_kernel.window_hidden_in_python):
        for wrong in (short, table):
            with pytest.raises((RuntimeError, ValueError), match="another shape"):
                call(window, torch.tensor([9]), *wrong)
    bad[1, 4] = window[1, 4]
    bad[1, 12] = -1  # past the n characters: never read
    assert torch.equal(made.op(bad, torch.tensor([9]), *args)[1], made.op(window, torch.tensor([9]), *args)[1])


@needs_kernel
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
@pytest.mark.parametrize(("n_embd", "prompt_length"), [(16, 1), (16, 13), (32, 5), (32, 20)])
def test_the_sampler_through_the_kernel_gives_the_plain_paths_characters(temperature, top_k, top_p, n_embd,
                                                                        prompt_length):
    # The fixed-shape step run eagerly (chunk 3), which compiled code runs: the window filling and full, a batch of 3
    m = gpt(n_embd, 2, True, block_size=8, n_layer=2, scale=0.1)
    with torch.no_grad():
        m.lm_head.weight.mul_(3)  # peaked distributions, as a trained model has: the draws matter
    prompt = torch.randint(0, 23, (3, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
    expected, expected_state = plain(m, prompt, 40, temperature, top_k, top_p, seed=7)
    sampler = WindowSampler(m, temperature, top_k, top_p, chunk=3, span=2, window_pass=window_kernel.window_pass(m))
    assert sampler.steps.pass_op is not None and sampler.steps.span == 1  # one character a pass
    got, got_state = windowed(sampler, prompt, 40, seed=7)
    assert torch.equal(got, expected)
    assert torch.equal(got_state, expected_state)


@needs_kernel
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logits_that_overflow_after_the_prompt_stop_the_kernels_sampler_after_the_same_character(temperature):
    m = gpt(16, 2, True, block_size=8, n_layer=2, scale=0.1)
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    late = overflowing_after(m, prompt)
    sampler = WindowSampler(late, temperature, None, None, chunk=3, window_pass=window_kernel.window_pass(late))
    assert len(drawn_until_overflow(sampler.generate_iter(prompt, 10, torch.Generator().manual_seed(1)))) == 1


def test_the_kernel_applies_only_to_models_whose_state_it_computes(monkeypatch):
    base = {"vocab_size": 23, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 32}
    assert window_kernel.applies(GPT(GPTConfig(**base)).eval())
    for other in ({"norm": "post"}, {"score": "additive"}, {"n_embd": 24}, {"n_head": 8}, {"n_embd": 48, "n_head": 4},
                  {"n_embd": 1024, "n_head": 1}):
        # post-norm and additive scores are other arithmetic; a width not in sixteens, a head size of 4, of 12 (not in
        # eights) or of 1,024 (past MAX_HEAD_SIZE)
        assert not window_kernel.applies(GPT(GPTConfig(**{**base, **other})).eval()), other
    assert not window_kernel.applies(GPT(GPTConfig(**base)))  # training mode: dropout
    assert not window_kernel.applies(GPT(GPTConfig(**base)).double().eval())
    assert window_kernel.window_pass(GPT(GPTConfig(**base)).eval(), batch=2) is None  # batches: the model's layers
    monkeypatch.setenv("TINYCHAR_GEMM", "0")  # PyTorch's products asked for
    assert not window_kernel.applies(GPT(GPTConfig(**base)).eval())
    assert window_kernel.window_pass(GPT(GPTConfig(**base)).eval()) is None


@needs_kernel
def test_the_sampler_takes_the_kernel_only_where_it_draws_one_character_a_pass_from_a_snapshot():
    m = gpt(32, 2, True, block_size=8, n_layer=1)
    made = window_kernel.window_pass(m)
    assert WindowSampler(m, 1.0, None, None, chunk=4, span=2, window_pass=made).steps.span == 1
    assert WindowSampler(m, 1.0, None, None, chunk=4, graph=True, window_pass=made).steps.pass_op is None
    trained = copy.deepcopy(m).train()
    assert WindowSampler(trained, 1.0, None, None, chunk=4, window_pass=made).steps.pass_op is None
    with pytest.raises(ValueError, match="span must be 1"):
        WindowSteps(m, None, 1.0, None, None, 4, 2, made)
    # the weights are packed when the pass is made: a model changed afterwards is not seen until it is made again
    window = torch.randint(0, 23, (1, 8), generator=torch.Generator().manual_seed(0))
    before = state(m, window, 8, False)
    with torch.no_grad():
        m.transformer.h[0].mlp.c_fc.weight.mul_(2)
    assert torch.equal(made.op(window, torch.tensor([8]), torch.empty(0), made.weights, 23, 32, 2, 1, True), before)
    assert not torch.allclose(state(m, window, 8, False), before)
