"""The later notes' modules: the fourth note's scaled dot-product and multi-head attention (d_k apart from d_v, the
padding mask, Add & Norm), checked against the GPT's own block, and the fifth note's single head."""

from __future__ import annotations

import pytest
import torch

from lab.notes_modules import MultiHeadAttention, ScaledDotProductAttention, single_head
from lab.walkthrough import walkthrough
from model import GPTConfig
from model.gpt import Block


def test_the_shapes_the_fourth_note_asserts():
    # 003: batch 2, 8 heads, len_q 4, len_k 6, d_k = d_v = 64; then MHA(8, 512, 64, 64) on (2, 10, 512)
    q, k, v = torch.randn(2, 8, 4, 64), torch.randn(2, 8, 6, 64), torch.randn(2, 8, 6, 64)
    out, weights = ScaledDotProductAttention(temperature=64**0.5)(q, k, v)
    assert out.shape == (2, 8, 4, 64) and weights.shape == (2, 8, 4, 6)
    x = torch.randn(2, 10, 512)
    out, weights = MultiHeadAttention(8, 512, 64, 64)(x, x, x)
    assert out.shape == (2, 10, 512) and weights.shape == (2, 8, 10, 10)


def test_keys_and_values_of_different_widths_scale_by_the_keys():
    torch.manual_seed(0)
    mha = MultiHeadAttention(n_head=4, d_model=32, d_k=8, d_v=24, dropout=0.0).eval()
    assert mha.w_qs.weight.shape == (32, 32) and mha.w_vs.weight.shape == (96, 32) and mha.fc.weight.shape == (32, 96)
    q_in, kv = torch.randn(2, 3, 32), torch.randn(2, 5, 32)  # cross-attention: 3 queries over 5 keys
    with torch.no_grad():
        out, weights = mha(q_in, kv, kv)
        q = mha.w_qs(q_in).view(2, 3, 4, 8).transpose(1, 2)
        k = mha.w_ks(kv).view(2, 5, 4, 8).transpose(1, 2)
        v = mha.w_vs(kv).view(2, 5, 4, 24).transpose(1, 2)
        expected = torch.softmax(q @ k.transpose(-2, -1) / 8**0.5, dim=-1)  # sqrt(d_k), not sqrt(d_v)
        heads = (expected @ v).transpose(1, 2).reshape(2, 3, 96)
        torch.testing.assert_close(weights, expected)
        torch.testing.assert_close(out, mha.layer_norm(q_in + mha.fc(heads)))  # Add & Norm around the queries


def test_the_padding_mask_agrees_with_the_notes_fill_and_keeps_a_sequence_as_it_is_alone():
    torch.manual_seed(1)
    mha = MultiHeadAttention(n_head=2, d_model=16, d_k=4, d_v=6, dropout=0.0).eval()
    x = torch.randn(2, 7, 16)
    keys = torch.ones(2, 1, 7, dtype=torch.long)
    keys[0, 0, 4:] = 0  # the first sequence holds 4 tokens, then 3 of padding; 0 hides, as the note writes it
    with torch.no_grad():
        out, weights = mha(x, x, x, keys)
        alone, _ = mha(x[:1, :4], x[:1, :4], x[:1, :4])
        scores = mha.w_qs(x).view(2, 7, 2, 4).transpose(1, 2) @ mha.w_ks(x).view(2, 7, 2, 4).transpose(1, 2).mT
        notes = torch.softmax((scores / 2).masked_fill(keys.unsqueeze(1) == 0, -1e9), dim=-1)  # 003's -1e9 fill
    torch.testing.assert_close(weights, notes)
    assert torch.all(weights[0, :, :, 4:] == 0)
    torch.testing.assert_close(out[0, :4], alone[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_head", [1, 4])
def test_given_a_post_norm_gpt_blocks_weights_it_is_that_blocks_attention_and_add_and_norm(n_head):
    config = GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=n_head, n_embd=32, dropout=0.0, bias=False,
                       norm="post")
    torch.manual_seed(2)
    block = Block(config).eval()
    with torch.no_grad():
        block.ln_1.weight.uniform_(0.5, 1.5)  # not the identity, so that a wrong norm shows
    mha = MultiHeadAttention(n_head, 32, 32 // n_head, 32 // n_head, dropout=0.0).eval()
    q, k, v = block.attn.c_attn.weight.split(32)
    with torch.no_grad():
        for mine, theirs in ((mha.w_qs, q), (mha.w_ks, k), (mha.w_vs, v), (mha.fc, block.attn.c_proj.weight)):
            mine.weight.copy_(theirs)
        mha.layer_norm.weight.copy_(block.ln_1.weight)
        mha.layer_norm.bias.zero_()
        mha.layer_norm.eps = block.ln_1.eps  # the note's 1e-6 against nn.LayerNorm's 1e-5: the one difference
        x = torch.randn(3, 8, 32)
        triangle = torch.ones(1, 8, 8).tril()  # (1, len_q, len_k): the same for every sequence
        theirs = block.add_attention(x, block.attn(block.attn_input(x))[0])
        out, _ = mha(x, x, x, triangle)
    torch.testing.assert_close(out, theirs, rtol=1e-5, atol=1e-5)


def test_the_fifth_notes_head_masks_the_future_and_its_scaling_keeps_unit_variance():
    torch.manual_seed(1337)
    head = single_head(torch.randn(4, 8, 32), head_size=16)
    assert head.weights.shape == (4, 8, 8) and head.out.shape == (4, 8, 16)
    assert torch.all(head.weights.triu(1) == 0)
    torch.testing.assert_close(head.weights.sum(-1), torch.ones(4, 8))
    assert 16 * 0.9 < head.variance_unscaled < 16 * 1.1 and 0.9 < head.variance_scaled < 1.1
    assert head.peak_scaled < 0.5 < head.peak_unscaled  # diffuse with the scaling, near one-hot without


def test_the_walkthrough_prints_the_later_notes_sections():
    text = walkthrough(2)
    assert "\n9. One head on a batch (004)" in text and "\n10. The fourth note's modules (003)" in text
    assert "-> output (2, 8, 4, 64), weights (2, 8, 4, 6)" in text  # the note's asserted shapes
    assert "-> output (2, 10, 512), weights (2, 8, 10, 10)" in text
    rows = text.split("then Add & Norm: LayerNorm(x + output).\n")[1].splitlines()[1:7]
    assert [r.split()[0] for r in rows] == ["Your", "journey", "starts", "with", "one", "step"]
    assert all(r.split()[-2:] == ["0.0000", "0.0000"] for r in rows)  # "one step", hidden as padding


def test_a_two_dimensional_mask_is_refused_rather_than_taken_across_the_heads():
    # (len_q, len_k) made (len_q, 1, len_k) would line up with the batch and the heads: with 4 heads and 4 queries
    # it ran, every head given one row of the triangle
    mha = MultiHeadAttention(4, 8, 2, 2, dropout=0.0)
    x = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match=r"mask must be \(B or 1, len_q or 1, len_k\).*got \(4, 4\)"):
        mha(x, x, x, torch.ones(4, 4).tril())
    _, weights = mha(x, x, x, torch.ones(1, 4, 4).tril())
    assert torch.all(weights.triu(1) == 0) and torch.all(weights[0, :, 3] > 0)  # the last query sees every key


def test_the_fifth_notes_head_is_the_recipe_it_prints():
    # seed, x, then the three layers from the same generator: what a reader typing the recipe gets
    torch.manual_seed(1337)
    x = torch.randn(4, 8, 32)
    head = single_head(x, head_size=16)
    torch.manual_seed(1337)
    x = torch.randn(4, 8, 32)
    key, query, value = (torch.nn.Linear(32, 16, bias=False) for _ in range(3))
    with torch.no_grad():
        wei = (query(x) @ key(x).mT / 4).masked_fill(torch.ones(8, 8).tril() == 0, float("-inf")).softmax(-1)
    torch.testing.assert_close(head.weights, wei)
    torch.testing.assert_close(head.out, wei @ value(x).detach())
