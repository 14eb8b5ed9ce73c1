"""Muon's Newton-Schulz iteration through tinychar's kernel (training/muon_kernel.py): as close to float64 as PyTorch's
float32 iteration, exactly symmetric, the same bits on any number of threads; which sizes and optimizers take it, and
under which TINYCHAR_GEMM; and that Muon's eager step runs it, with PyTorch's losses to rounding. The compiled step's
use of it: tests/test_training_kernels.py; a run with it resuming exactly: tests/test_training_eager_kernels.py."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_cpu_compile
from test_training_eager_kernels import three_eager_steps

from model import GPT, GPTConfig
from training import TrainConfig, eager_kernels, muon_kernel
from training.optim import Muon, make_optimizer, newton_schulz_iteration, orthogonalize_each

CPU = torch.device("cpu")


def grams(count: int, rows: int, columns: int, seed: int) -> torch.Tensor:
    """Gram matrices of count normalised rows x columns matrices, in float64, as gram_newton_schulz makes them."""
    x = torch.randn(count, rows, columns, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    x = x / x.norm(dim=(-2, -1), keepdim=True)
    return x @ x.mT


@needs_cpu_compile
@pytest.mark.parametrize(("count", "size", "columns"), [(1, 16, 48), (3, 48, 48), (4, 64, 256), (2, 128, 384),
                                                        (5, 32, 32)])
def test_the_kernel_iterates_as_close_to_float64_as_pytorch_and_exactly_symmetric(count, size, columns):
    """Against the iteration in float64: within twice the error of PyTorch's own float32 iteration (measured, 0.8-1.3
    times it; square matrices, whose small singular values the iteration magnifies, err most), on one thread and on
    two alike to the bit, each Q exactly symmetric (its values below the diagonal copied from above)."""
    gram = grams(count, size, columns, seed=size)
    expected = newton_schulz_iteration(gram)
    pytorchs = (newton_schulz_iteration(gram.float()).double() - expected).abs().max().item()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = muon_kernel.newton_schulz_in_python(gram.float())
        torch.set_num_threads(2)
        two = muon_kernel.newton_schulz_in_python(gram.float())
    finally:
        torch.set_num_threads(threads)
    assert (one.double() - expected).abs().max().item() <= 2 * pytorchs + 1e-6
    assert torch.equal(one, two) and torch.equal(one, one.mT)


@needs_cpu_compile
@pytest.mark.parametrize("shape", [(16, 16), (2, 16, 32), (1, 24, 24)])
def test_the_operator_refuses_what_is_not_a_stack_of_square_matrices_sides_a_multiple_of_16(shape):
    for call in (muon_kernel.newton_schulz, muon_kernel.newton_schulz_in_python):  # C++, where loaded; Python
        with pytest.raises((RuntimeError, ValueError), match="a stack of square matrices, sides a multiple of 16"):
            call(torch.zeros(shape))


def test_sizes_of_sixteen_up_to_the_largest_measured_take_it_and_others_pytorchs_iteration():
    assert [muon_kernel.fits(n) for n in (16, 64, 128, muon_kernel.MAX_SIZE)] == [True] * 4
    assert [muon_kernel.fits(n) for n in (0, 8, 24, 100, muon_kernel.MAX_SIZE + 16)] == [False] * 5
    for gram in (grams(2, 24, 40, seed=1).float(), grams(2, 16, 40, seed=1)):  # a size it does not take; float64
        assert torch.equal(muon_kernel.iterate(gram), newton_schulz_iteration(gram))


@needs_cpu_compile
def test_a_blocks_matrices_orthogonalised_through_the_kernel():
    """orthogonalize_each of two blocks' four matrices each (3d x d, d x d, 4d x d, d x 4d; d = 32) with the kernel:
    within 2e-5 of float64's (PyTorch's float32 measured 1e-5 from it), in the same shapes."""
    gen = torch.Generator().manual_seed(2)
    d = 32
    matrices = [torch.randn(shape, generator=gen) for _ in range(2) for shape in
                ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))]
    expected = orthogonalize_each([m.double() for m in matrices])
    got = orthogonalize_each(matrices, None, muon_kernel.iterate)
    assert [g.shape for g in got] == [m.shape for m in matrices]
    assert max((g.double() - e).abs().max().item() for g, e in zip(got, expected, strict=True)) < 2e-5


def muon(width: int) -> Muon:
    model = GPT(GPTConfig(vocab_size=12, block_size=8, n_layer=1, n_head=1, n_embd=width, dropout=0.0))
    return make_optimizer(model, TrainConfig(optimizer="muon"), CPU)


@needs_cpu_compile
def test_muon_takes_it_where_tinychars_products_are_taken_and_a_matrix_fits(monkeypatch):
    """Under TINYCHAR_GEMM's rule (auto: AMD's CPUs without AVX-512; 1: any CPU; 0: none), for a Muon optimizer one
    of whose matrices fits; AdamW has no iteration."""
    monkeypatch.setenv("TINYCHAR_GEMM", "1")
    optimizer = muon(16)
    assert optimizer.iterate is None and muon_kernel.attach(optimizer) and optimizer.iterate is muon_kernel.iterate
    assert not muon_kernel.attach(muon(24))  # 72 x 24, 24 x 24, 96 x 24, 24 x 96: none fits
    model = GPT(GPTConfig(vocab_size=12, block_size=8, n_layer=1, n_head=1, n_embd=16, dropout=0.0))
    assert not muon_kernel.attach(make_optimizer(model, TrainConfig(), CPU))
    monkeypatch.setenv("TINYCHAR_GEMM", "0")
    optimizer = muon(16)
    assert not muon_kernel.ready(optimizer) and not muon_kernel.attach(optimizer) and optimizer.iterate is None


@needs_cpu_compile
def test_muons_eager_step_runs_it_with_pytorchs_losses(monkeypatch):
    """Three eager Muon steps with the kernel (eager_kernels.attach, given the optimizer) against three without: the
    kernel ran once a step, through Python (its C++ is not built for the eager step), the losses within 2e-6 and the
    weights within 1e-6 of PyTorch's; eager_kernels.attached names it, for the checkpoint's settled setup."""
    monkeypatch.setenv("TINYCHAR_GEMM", "1")
    monkeypatch.setattr(muon_kernel._KERNEL, "operators", lambda *a: pytest.fail("the eager step built the C++"))
    cfg = GPTConfig(vocab_size=12, block_size=8, n_layer=1, n_head=1, n_embd=16, dropout=0.0)
    xs = torch.randint(0, 12, (4, 8), generator=torch.Generator().manual_seed(0))

    def three_steps(kernel: bool) -> tuple[list[float], torch.Tensor, dict[str, int]]:
        torch.manual_seed(0)
        model = GPT(cfg)
        optimizer = make_optimizer(model, TrainConfig(optimizer="muon"), CPU)
        if kernel:
            assert eager_kernels.attach(model, 4 * 8, optimizer=optimizer) == ["Muon"]
            assert eager_kernels.attached(model, optimizer) == ["Muon"]
        losses, ran = three_eager_steps(model, optimizer, xs)
        return losses, torch.cat([p.detach().flatten() for p in model.parameters()]), ran

    plain_losses, plain_weights, plain_ran = three_steps(kernel=False)
    losses, weights, ran = three_steps(kernel=True)
    assert plain_ran == {} and ran == {"newton_schulz": 3}
    assert losses == pytest.approx(plain_losses, abs=2e-6)
    assert 0 < (weights - plain_weights).abs().max() < 1e-6
