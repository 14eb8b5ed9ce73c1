"""The GPT: shapes, the causal mask, the two attention paths, initial loss, learning, generation."""

from __future__ import annotations

import math

import pytest
import torch

from model import GPT, GPTConfig, masked_attention
from model.attention import causal_bias, fused_attention


def tiny(**kw) -> GPT:
    cfg = {"vocab_size": 11, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16, "dropout": 0.0}
    cfg.update(kw)
    torch.manual_seed(0)
    return GPT(GPTConfig(**cfg)).eval()


def test_forward_shapes_and_loss_none_without_targets():
    model = tiny()
    idx = torch.randint(0, 11, (3, 8))
    logits, loss = model(idx)
    assert logits.shape == (3, 8, 11)
    assert loss is None
    logits, loss = model(idx, idx)
    assert loss.ndim == 0


@pytest.mark.parametrize(("attention", "score", "norm"), [("manual", "dot", "pre"), ("fused", "dot", "pre"),
                                                          ("manual", "additive", "pre"), ("manual", "dot", "post")])
def test_mask_hides_the_future(attention, score, norm):
    model = tiny(attention=attention, score=score, norm=norm)
    torch.manual_seed(1)
    idx = torch.randint(0, 11, (2, 8))
    logits, _ = model(idx)
    for t in range(8):
        changed = idx.clone()
        changed[:, t + 1 :] = torch.randint(0, 11, (2, 8 - t - 1))
        logits2, _ = model(changed)
        torch.testing.assert_close(logits2[:, : t + 1], logits[:, : t + 1], atol=1e-6, rtol=0)
        if t < 7:  # the past does change later positions, so the check above is not vacuous
            changed_past = idx.clone()
            changed_past[:, t] = (idx[:, t] + 1) % 11
            logits3, _ = model(changed_past)
            assert not torch.allclose(logits3[:, t:], logits[:, t:])


def test_each_layer_keeps_the_triangular_mask_as_a_bias_of_zero_and_minus_infinity():
    for block in tiny(block_size=5).transformer.h:
        mask = block.attn.mask
        assert mask.dtype == torch.float32 and mask.shape == (5, 5)
        visible = torch.tril(torch.ones(5, 5, dtype=torch.bool))
        assert (mask[visible] == 0).all() and (mask[~visible] == float("-inf")).all()


@pytest.mark.parametrize("T", [6, 8, 9, 64])  # the transposed softmax up to 8 keys, the plain one above
@pytest.mark.parametrize("rows", ["all", "one"])  # training's square mask, the sampler's one row of it
def test_the_bias_mask_gives_the_boolean_masks_attention_exactly(T, rows):
    """masked_attention takes the mask as booleans (the lab) or as the bias the model keeps: the same weights,
    outputs and gradients, to the bit."""
    torch.manual_seed(T)
    visible = torch.tril(torch.ones(T, T, dtype=torch.bool))
    bias = causal_bias(T)
    assert torch.equal(bias, torch.zeros(T, T).masked_fill(~visible, float("-inf")))  # 0 where seen, -inf elsewhere
    if rows == "one":
        visible, bias = visible[T // 2 : T // 2 + 1], bias[T // 2 : T // 2 + 1]
    scores = torch.randn(3, 2, visible.size(0), T) * 4
    v = torch.randn(3, 2, T, 5)
    results = []
    for mask in (visible, bias):
        s, w = scores.clone().requires_grad_(), v.clone().requires_grad_()
        y, weights = masked_attention(s, w, mask)
        (y * torch.linspace(-1, 1, 5)).sum().backward()
        results.append((y, weights, s.grad, w.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert (results[1][1][..., ~visible.expand_as(results[1][1][0, 0])] == 0).all()


def test_manual_and_fused_attention_agree():
    manual, fused = tiny(attention="manual"), tiny(attention="fused")
    fused.load_state_dict(manual.state_dict())
    idx = torch.randint(0, 11, (4, 8))
    torch.testing.assert_close(manual(idx)[0], fused(idx)[0], atol=1e-5, rtol=1e-5)


def test_fused_attention_with_dropout_under_a_cpu_s_autocast_traces_for_the_compiled_step():
    """configs/shakespeare_char.yaml on a CPU with bfloat16: the compiled step (torch.func.grad_and_value under
    torch.compile) could not trace fused attention's dropout under autocast, and the run trained eagerly after a page
    of torch's traceback. Traced here as the step is, without inductor's code generation (the tracing failed)."""
    model = tiny(attention="fused", dropout=0.2).train()
    params = dict(model.named_parameters())
    idx = torch.randint(0, 11, (4, 8))

    def loss_of(p: dict, idx: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.func.functional_call(model, p, (idx, idx))[1]

    grads, loss = torch.compile(torch.func.grad_and_value(loss_of), backend="eager", fullgraph=True)(params, idx)
    assert loss.isfinite() and all(g.isfinite().all() and g.abs().sum() > 0 for g in grads.values())
    # and eagerly the same numbers as autocast's own form, dropout's draws included
    q, k, v = torch.randn(3, 2, 2, 8, 4).unbind(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(3)
        ours = fused_attention(q, k, v, dropout_p=0.2, is_causal=True)
        torch.manual_seed(3)
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
    assert ours.dtype == theirs.dtype == torch.bfloat16 and torch.equal(ours, theirs)


@pytest.mark.parametrize("score", ["dot", "additive"])
def test_manual_attention_takes_the_fused_kernel_only_for_eager_inference_without_weights(score):
    model = tiny(score=score)
    attn = model.transformer.h[0].attn
    assert not attn.takes_fused_kernel()  # gradients on: training runs the notes' steps
    with torch.no_grad():
        assert attn.takes_fused_kernel() is (score == "dot")  # the fused kernel only does dot products
        assert not attn.takes_fused_kernel(need_weights=True)  # attention maps show the steps' own weights
        model.train()
        assert not attn.takes_fused_kernel()  # train mode: dropout draws as the steps draw


def test_inference_through_the_fused_kernel_gives_the_explicit_steps_logits(monkeypatch):
    model = tiny()
    idx = torch.randint(0, 11, (4, 8), generator=torch.Generator().manual_seed(3))
    explicit = model(idx)[0].detach()
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        fused = model(idx)[0]
        assert len(calls) == 2  # once per layer
        _, _, weights = model(idx, return_attention=True)
        assert len(calls) == 2 and len(weights) == 2
    torch.testing.assert_close(fused, explicit, atol=1e-6, rtol=0)


def test_initial_loss_is_near_uniform():
    model = tiny(vocab_size=65, n_embd=32)
    idx, targets = torch.randint(0, 65, (16, 8)), torch.randint(0, 65, (16, 8))
    _, loss = model(idx, targets)  # targets unrelated to the inputs, as at the start of training
    assert abs(loss.item() - math.log(65)) < 0.1


def test_small_model_overfits_a_short_text():
    text = "hello world, hello tinychar! "
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text * 4])
    model = tiny(vocab_size=len(chars), block_size=16, n_embd=32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.stack([ids[i : i + 16] for i in range(0, 64, 4)])
    y = torch.stack([ids[i + 1 : i + 17] for i in range(0, 64, 4)])
    for _ in range(300):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1


def test_weights_are_tied_and_residual_projections_scaled():
    model = tiny(n_layer=4, n_embd=64)
    assert model.lm_head.weight is model.transformer.wte.weight
    proj = model.transformer.h[0].attn.c_proj.weight
    assert abs(proj.std().item() - 0.02 / math.sqrt(8)) < 0.002
    total = sum(p.numel() for p in model.parameters())
    assert model.num_params() == total - model.transformer.wpe.weight.numel()


def test_sequence_longer_than_block_size_is_refused():
    model = tiny()
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_return_attention_gives_each_layer_and_head():
    model = tiny()
    idx = torch.randint(0, 11, (3, 5))
    logits, _, weights = model(idx, return_attention=True)
    torch.testing.assert_close(logits, model(idx)[0])
    assert len(weights) == 2
    for w in weights:
        assert w.shape == (3, 2, 5, 5)
        torch.testing.assert_close(w.sum(-1), torch.ones(3, 2, 5))
        assert torch.all(w.triu(1) == 0)


HELLO = "hello world, hello tinychar! "


@pytest.fixture(scope="module")
def trained() -> tuple[GPT, list[str]]:
    """A GPT of block_size 8 fitted to HELLO (about 1 s), and its vocabulary. An untrained model's next character
    hardly depends on the context (greedy decoding repeats one character), so a KV cache that kept stale keys
    generated the same characters as none; this one's text follows its context, and a stale cache shows."""
    chars = sorted(set(HELLO))
    ids = torch.tensor([chars.index(c) for c in HELLO * 4])
    model = tiny(vocab_size=len(chars), n_embd=32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.stack([ids[i : i + 8] for i in range(100)])
    y = torch.stack([ids[i + 1 : i + 9] for i in range(100)])
    for _ in range(100):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), chars


@pytest.mark.parametrize("attention", ["manual", "fused"])
def test_kv_cache_generates_the_same_characters(trained, attention):
    fitted, chars = trained
    model = tiny(vocab_size=len(chars), n_embd=32, attention=attention)
    model.load_state_dict(fitted.state_dict())
    prompt = torch.tensor([[chars.index(c) for c in p] for p in ("hel", "rld")])
    # 30 new characters: well past block_size 8, so the window slides and the cache is rebuilt
    with_cache = model.generate(prompt, 30, generator=torch.Generator().manual_seed(5), use_cache=True)
    without = model.generate(prompt, 30, generator=torch.Generator().manual_seed(5), use_cache=False)
    assert with_cache.shape == (2, 33)
    assert torch.equal(with_cache, without)
    assert all(len(set(row[3:])) > 5 for row in with_cache.tolist())  # text that depends on its context


def test_post_norm_blocks_add_and_normalise_as_the_notes_do_and_need_no_last_layer_norm():
    """model.norm=post is the notes' Add & Norm (note 003's MultiHeadAttention, the first transformer):
    ln_1(x + attention(x)), then ln_2(h + mlp(h)); pre-norm (GPT-2's) normalises what each sublayer reads instead."""
    post, pre = tiny(norm="post"), tiny()
    assert isinstance(post.transformer.ln_f, torch.nn.Identity) and isinstance(pre.transformer.ln_f, torch.nn.LayerNorm)
    assert set(pre.state_dict()) - set(post.state_dict()) == {"transformer.ln_f.weight", "transformer.ln_f.bias"}
    post.load_state_dict(pre.state_dict(), strict=False)  # the same weights, placed as post-norm places them
    idx = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        x = post.embed(idx)
        for block in post.transformer.h:
            a, _ = block.attn(x)
            h = block.ln_1(x + a)
            x = block.ln_2(h + block.mlp(h))
        torch.testing.assert_close(post.hidden(idx)[0], x, rtol=0, atol=1e-6)
        assert not torch.allclose(pre.hidden(idx)[0], x, atol=1e-3)
        # each position's output is layer-normalised: mean 0, variance 1 (the norms start with weight 1, bias 0)
        torch.testing.assert_close(x.mean(-1), torch.zeros(2, 8), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="model.norm must be one of pre, post, got 'middle'"):
        GPTConfig(norm="middle")
    with pytest.raises(ValueError, match="model.norm=post means nothing for model.type=gru"):
        GPTConfig(type="gru", norm="post")


def test_a_post_norm_model_generates_the_same_characters_with_and_without_its_cache():
    model = tiny(norm="post")
    prompt = torch.randint(0, 11, (2, 3), generator=torch.Generator().manual_seed(2))
    with_cache = model.generate(prompt, 30, generator=torch.Generator().manual_seed(5), use_cache=True)
    assert torch.equal(with_cache, model.generate(prompt, 30, generator=torch.Generator().manual_seed(5),
                                                  use_cache=False))


@pytest.mark.parametrize("keep", [None, 1, 4, 6])
def test_window_policy_is_the_same_with_and_without_cache(trained, keep):
    model, chars = trained
    prompt = torch.tensor([[chars.index(c) for c in "hello world"]])  # longer than block_size 8: cropped
    kwargs = {"temperature": 0.0, "keep": keep}
    with_cache = model.generate(prompt, 40, use_cache=True, **kwargs)
    assert torch.equal(with_cache, model.generate(prompt, 40, use_cache=False, **kwargs))
    assert len(set(with_cache[0, 11:].tolist())) > 5  # not one character repeated, which any window would give


def test_default_window_sees_the_last_block_size_characters():
    """keep=None is nanoGPT's rule: every prediction is made from the last block_size characters."""
    model = tiny()
    idx = torch.randint(0, 11, (1, 3))
    out = model.generate(idx, 20, temperature=0.0)
    expected = idx
    for _ in range(20):
        logits, _ = model(expected[:, -8:])
        expected = torch.cat([expected, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, expected)


def test_a_full_window_starts_again_from_its_last_keep_characters(trained):
    """keep: once the window holds block_size characters, the next one starts a window of the last keep of them and
    the new one, which then grows to block_size again. (The test above compares the two paths, which share the
    rule: generate ignoring keep passed it.)"""
    model, chars = trained
    idx = torch.tensor([[chars.index(c) for c in "hel"]])
    default = model.generate(idx, 20, temperature=0.0)
    differ = []
    for keep in (1, 2, 3, 4):
        expected, start = idx, 0
        for _ in range(20):
            end = expected.size(1)
            if end - start > 8:  # block_size
                start = end - keep - 1
            logits, _ = model(expected[:, start:end])
            expected = torch.cat([expected, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        for use_cache in (True, False):
            assert torch.equal(model.generate(idx, 20, temperature=0.0, keep=keep, use_cache=use_cache), expected)
        differ.append(not torch.equal(expected, default))
    assert any(differ)  # the windows matter to this model: some keep gives other characters than the default


def test_keep_out_of_range_is_refused():
    with pytest.raises(ValueError, match="keep"):
        tiny().generate(torch.zeros(1, 1, dtype=torch.long), 3, keep=8)


def test_a_window_of_one_character_generates_with_and_without_cache():
    # block_size 1 is a valid config; generate's default keep (block_size - 1) is then 0, which was refused, so a run
    # with model.block_size=1 crashed at its first evaluation sample
    model = tiny(block_size=1)
    prompt = torch.randint(0, 11, (2, 4), generator=torch.Generator().manual_seed(0))
    with_cache = model.generate(prompt, 15, generator=torch.Generator().manual_seed(5))
    without = model.generate(prompt, 15, generator=torch.Generator().manual_seed(5), use_cache=False)
    assert with_cache.shape == (2, 19) and torch.equal(with_cache, without)
    assert torch.equal(model.generate(prompt, 15, generator=torch.Generator().manual_seed(5), keep=0), with_cache)
    greedy, expected = model.generate(prompt, 10, temperature=0.0), prompt
    for _ in range(10):  # each prediction from the last character alone
        logits, _ = model(expected[:, -1:])
        expected = torch.cat([expected, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy, expected)
    with pytest.raises(ValueError, match=r"keep must be in \[0, block_size - 1\] = \[0, 0\], got 1"):
        model.generate(prompt, 3, keep=1)
    with pytest.raises(ValueError, match=r"keep must be in \[1, block_size - 1\] = \[1, 7\], got 0"):
        tiny().generate(prompt, 3, keep=0)  # with a wider window, keeping nothing stays refused


BAD_ARGUMENTS = [
    ({"temperature": -1.0}, "temperature must be a finite number >= 0"),  # was: sampled the unlikeliest characters
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),  # was: silently greedy
    ({"temperature": float("inf")}, "temperature must be a finite number >= 0"),
    ({"top_k": 0}, "top_k must be >= 1"),
    ({"top_k": -3}, "top_k must be >= 1"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_p": float("nan")}, r"top_p must be in \(0, 1\]"),
    ({"max_new_tokens": -1}, "max_new_tokens must be >= 0, got -1"),
    ({"max_new_tokens": -5}, "max_new_tokens must be >= 0, got -5"),
    ({"idx": torch.zeros(1, 0, dtype=torch.long)}, r"idx must be .* got shape \(1, 0\)"),
    ({"idx": torch.zeros(3, dtype=torch.long)}, r"idx must be .* got shape \(3,\)"),
]


@pytest.mark.parametrize("kind", ["gpt", "bigram", "gru", "lstm"])
@pytest.mark.parametrize(("bad", "message"), BAD_ARGUMENTS)
def test_bad_sampling_arguments_raise_a_value_error_naming_them(kind, bad, message):
    from model import build_model

    torch.manual_seed(0)
    model = build_model(GPTConfig(type=kind, vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)).eval()
    args = {"idx": torch.tensor([[1, 2, 3]]), "max_new_tokens": 3, **bad}
    with pytest.raises(ValueError, match=message):
        model.generate(**args)
    with pytest.raises(ValueError, match=message):
        model.generate_iter(**args)  # when it is called, not at its first character


def test_the_edges_of_the_sampling_arguments_are_accepted():
    model, idx = tiny(), torch.tensor([[1, 2, 3]])
    assert torch.equal(model.generate(idx, 0), idx)
    assert list(model.generate_iter(idx, 0)) == []
    for kwargs in ({"temperature": 0.0}, {"top_k": 1}, {"top_k": 100}, {"top_p": 1.0}, {"top_p": 1e-300}):
        assert model.generate(idx, 4, generator=torch.Generator().manual_seed(0), **kwargs).shape == (1, 7)


def test_cached_logits_equal_full_forward():
    from model import KVCache

    model = tiny()
    idx = torch.randint(0, 11, (2, 8))
    full, _ = model(idx)
    cache = KVCache(model.config, 2, torch.device("cpu"), torch.float32)
    x, _ = model.hidden(idx[:, :3], cache)
    steps = [model.lm_head(x)]
    for t in range(3, 8):
        x, _ = model.hidden(idx[:, t : t + 1], cache)
        steps.append(model.lm_head(x))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_generation_is_reproducible_and_respects_options():
    model = tiny()
    prompt = torch.zeros(1, 1, dtype=torch.long)
    a = model.generate(prompt, 20, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, 20, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    greedy = model.generate(prompt, 10, temperature=0.0)
    assert torch.equal(greedy, model.generate(prompt, 10, temperature=0.0))
    top1 = model.generate(prompt, 10, top_k=1, generator=torch.Generator().manual_seed(9))
    assert torch.equal(top1, greedy)  # keeping only the likeliest character is greedy decoding
    tiny_p = model.generate(prompt, 10, top_p=1e-6, generator=torch.Generator().manual_seed(9))
    assert torch.equal(tiny_p, greedy)


def test_sample_next_top_k_and_top_p_only_draw_allowed_ids():
    from model import sample_next

    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]]).repeat(200, 1)
    gen = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, top_k=2, generator=gen).flatten().tolist()) <= {3, 4}
    probs = torch.softmax(logits[0], -1)  # 0.64, 0.24, ... : top_p=0.7 keeps ids 4 and 3
    assert probs[4] < 0.7 < probs[4] + probs[3]
    assert set(sample_next(logits, top_p=0.7, generator=gen).flatten().tolist()) == {3, 4}


def test_flops_per_token_counts_every_matrix_weight_and_attention():
    model = tiny(bias=False, n_layer=3, n_embd=32, n_head=4, block_size=8)
    C, L, T = 32, 3, 8
    norm_weights = (2 * L + 1) * C  # layer norms: not matrix multiplies
    matrix_weights = model.num_params() - norm_weights  # num_params() already leaves out the position table
    assert model.flops_per_token() == 6 * matrix_weights + 12 * L * T * C


@pytest.mark.parametrize(("temperature", "top_p"), [(1e-40, None), (1e-300, None), (5e-324, 1e-300), (1e-45, 0.9)])
def test_a_temperature_too_small_for_float32_is_greedy_not_a_crash(temperature, top_p):
    from model import sample_next

    logits = torch.randn(4, 65, generator=torch.Generator().manual_seed(0))
    picked = sample_next(logits, temperature, None, top_p, torch.Generator().manual_seed(1))
    assert torch.equal(picked, logits.argmax(dim=-1, keepdim=True))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("n_layer", 2.5, "model.n_layer must be an integer, got 2.5"),
    ("n_head", True, "model.n_head must be an integer, got True"),
    ("bias", "yes", "model.bias must be true or false, got 'yes'"),
    ("dropout", "0.1", "model.dropout must be a number, got '0.1'"),
    ("attention", 3, "model.attention must be a string, got 3"),
])
def test_a_model_config_has_the_types_it_declares(field, value, message):
    with pytest.raises(ValueError) as info:
        GPTConfig(**{field: value})
    assert str(info.value) == message


def test_a_models_size_is_said_in_millions_and_a_small_one_whole():
    from model.config import parameters_text

    assert parameters_text(154_752) == "0.15M parameters" and parameters_text(10_000) == "0.01M parameters"
    assert parameters_text(4_225) == "4,225 parameters"  # a bigram table read "0.00M parameters"


@pytest.mark.parametrize("kind", ["gpt", "gru", "lstm"])
def test_a_model_one_number_wide_is_refused_for_its_layer_norm_reads_nothing(kind):
    """A layer norm over one number gives its bias whatever the number, so such a model's logits were the same for
    every text (trained on "abab...", its loss stayed at ln 2): refused, as a config that cannot learn."""
    with pytest.raises(ValueError) as info:
        GPTConfig(type=kind, vocab_size=5, n_head=1, n_embd=1)
    assert str(info.value).startswith(f"model.n_embd must be >= 2 for a{'n' if kind == 'lstm' else ''} {kind} model, "
                                      "got 1")
    # two numbers are enough to tell texts apart (a layer norm over two keeps their order), and the bigram table
    # takes no width at all
    from model.baselines import build_model

    torch.manual_seed(0)
    model = build_model(GPTConfig(type=kind, vocab_size=5, block_size=4, n_head=1, n_embd=2))
    logits = model(torch.arange(5).repeat_interleave(4).view(5, 4))[0]  # (5, 4, 5): each character 4 times over
    assert not (logits == logits[0]).all()
    GPTConfig(type="bigram", n_head=1, n_embd=1)
