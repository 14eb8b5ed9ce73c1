"""lab/notes.py, part 2: the causal mask, dropout on the attention weights, CausalAttention and the multi-head
modules, and additive scoring beside the dot product; attention without and with trainable weights is in
test_lab_notes.

The literals below are typed from the printed outputs of 001 (cell numbers are its ``In [n]``) and compared to the
4 decimals the notes show. Where the notes print nothing (dropout, the causal and multi-head modules, additive
scoring) the tests check the behaviour instead: the mask hides the future, the two multi-head forms agree, the lab
runs the model's code.
"""

from __future__ import annotations

import pytest
import torch
from notes_numbers import ALL_WEIGHTS, V2_001_SEED_123, close
from torch import nn

from lab import notes as lab
from lab.notes import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v2,
    v2_as_built_in_001,
)
from model.attention import CausalSelfAttention
from model.config import GPTConfig

INF = float("inf")


@pytest.fixture
def inputs() -> torch.Tensor:
    return lab.journey_inputs()


# --- Causal masking (001 In[59]-In[64]) --------------------------------------------------------------------

V2_001_WEIGHTS = [
    [0.1827, 0.1681, 0.1682, 0.1577, 0.1660, 0.1573],
    [0.1675, 0.1732, 0.1730, 0.1607, 0.1623, 0.1634],
    [0.1675, 0.1731, 0.1730, 0.1607, 0.1623, 0.1634],
    [0.1650, 0.1705, 0.1703, 0.1642, 0.1640, 0.1660],
    [0.1661, 0.1713, 0.1711, 0.1630, 0.1635, 0.1650],
    [0.1657, 0.1707, 0.1706, 0.1636, 0.1638, 0.1655],
]
V2_001_MASKED_SCORES = [
    [0.2477, -INF, -INF, -INF, -INF, -INF],
    [0.1748, 0.2214, -INF, -INF, -INF, -INF],
    [0.1739, 0.2210, 0.2194, -INF, -INF, -INF],
    [0.0730, 0.1196, 0.1184, 0.0668, -INF, -INF],
    [0.1086, 0.1515, 0.1502, 0.0814, 0.0858, -INF],
    [0.0895, 0.1316, 0.1305, 0.0717, 0.0734, 0.0875],
]
V2_001_CAUSAL_WEIGHTS = [
    [1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.4918, 0.5082, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.3261, 0.3371, 0.3368, 0.0000, 0.0000, 0.0000],
    [0.2462, 0.2544, 0.2542, 0.2451, 0.0000, 0.0000],
    [0.1990, 0.2051, 0.2049, 0.1952, 0.1958, 0.0000],
    [0.1657, 0.1707, 0.1706, 0.1636, 0.1638, 0.1655],
]
SIMPLE_MASKED = [
    [0.2098, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.1385, 0.2379, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.1390, 0.2369, 0.2326, 0.0000, 0.0000, 0.0000],
    [0.1435, 0.2074, 0.2046, 0.1462, 0.0000, 0.0000],
    [0.1526, 0.1958, 0.1975, 0.1367, 0.1879, 0.0000],
    [0.1385, 0.2184, 0.2128, 0.1420, 0.0988, 0.1896],
]
SIMPLE_RENORMALISED = [
    [1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.3680, 0.6320, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.2284, 0.3893, 0.3822, 0.0000, 0.0000, 0.0000],
    [0.2046, 0.2956, 0.2915, 0.2084, 0.0000, 0.0000],
    [0.1753, 0.2250, 0.2269, 0.1570, 0.2158, 0.0000],
    [0.1385, 0.2184, 0.2128, 0.1420, 0.0988, 0.1896],
]


def test_causal_mask_is_the_lower_triangle() -> None:
    """001 In[60]: torch.tril(torch.ones(6, 6))."""
    expected = [[1.0 if j <= i else 0.0 for j in range(6)] for i in range(6)]
    close(lab.causal_mask(6).float(), expected)


def test_causal_masking_of_001_with_the_v2_weights(inputs: torch.Tensor) -> None:
    """001 In[59], In[63], In[64]: the v2 weights, its raw scores with -inf above the diagonal, and the softmax of
    those scaled by 1/sqrt(2). Way (b) is the model's ``masked_attention``; way (a), renormalising In[59]'s weights,
    gives the same matrix."""
    v2 = v2_as_built_in_001()
    queries, keys, values = v2.W_query(inputs), v2.W_key(inputs), v2.W_value(inputs)
    scores = queries @ keys.T  # (6, 6), unscaled, as 001 prints them
    weights = torch.softmax(scores / 2**0.5, dim=-1)
    close(weights, V2_001_WEIGHTS)
    close(torch.where(lab.causal_mask(6), scores, -INF), V2_001_MASKED_SCORES)

    _, masked_weights = lab.causal_softmax_attention(scores / 2**0.5, values)
    close(masked_weights, V2_001_CAUSAL_WEIGHTS)
    close(lab.renormalised_causal_weights(weights), V2_001_CAUSAL_WEIGHTS)


def test_causal_masking_of_001_with_the_simple_weights(inputs: torch.Tensor) -> None:
    """001 In[61], In[62]: the mask-and-renormalise cell multiplies ``atten_weights`` (the weights without trainable
    matrices, In[15]) where the cell above it computed ``attn_weights`` from v2: a name mix-up, so 001's way (a)
    and way (b) mask different matrices and their last rows differ (0.1385... vs 0.1657...). The printed numbers
    are right for the matrix used; applied to one matrix the two ways agree exactly."""
    scores, weights, _ = lab.simple_self_attention(inputs)
    close(weights * lab.causal_mask(6), SIMPLE_MASKED)
    close(lab.renormalised_causal_weights(weights), SIMPLE_RENORMALISED)
    _, masked_weights = lab.causal_softmax_attention(scores, inputs)
    close(masked_weights, SIMPLE_RENORMALISED)


def test_both_causal_ways_agree_on_random_scores() -> None:
    scores = torch.randn(2, 3, 7, 7, generator=torch.Generator().manual_seed(0))
    _, masked_weights = lab.causal_softmax_attention(scores, torch.zeros(2, 3, 7, 1))
    renormalised = lab.renormalised_causal_weights(torch.softmax(scores, dim=-1))
    torch.testing.assert_close(masked_weights, renormalised)
    assert (masked_weights[..., ~lab.causal_mask(7)] == 0).all()


# --- Dropout on the attention weights ----------------------------------------------------------------------


def test_dropout_zeroes_or_scales_by_one_over_keep() -> None:
    """With p = 0.5 every kept entry is doubled (1 / (1 - p)) and the rest are exactly zero, so each weight keeps its
    expected value. The notes print no dropout example; the seed only makes the draw repeatable."""
    torch.manual_seed(123)
    dropped = lab.drop_attention_weights(torch.ones(6, 6), p=0.5)
    assert set(dropped.unique().tolist()) <= {0.0, 2.0}
    assert 0 < (dropped == 0).sum() < 36

    weights = torch.tensor(ALL_WEIGHTS)
    torch.manual_seed(123)
    dropped = lab.drop_attention_weights(weights, p=0.2)
    kept = dropped != 0
    torch.testing.assert_close(dropped[kept], weights[kept] / 0.8)
    large = lab.drop_attention_weights(torch.ones(200, 200), p=0.2)
    assert abs(large.mean().item() - 1.0) < 0.02


def test_causal_attention_dropout_acts_only_in_training(inputs: torch.Tensor) -> None:
    torch.manual_seed(123)
    head = CausalAttention(3, 2, context_length=6, dropout=0.5)
    batch = inputs.unsqueeze(0)  # (1, 6, 3)
    head.eval()
    _, clean = head.attend(batch)
    head.train()
    _, dropped = head.attend(batch)
    kept = dropped != 0
    assert not kept.all()
    torch.testing.assert_close(dropped[kept], 2 * clean[kept])


# --- CausalAttention and the multi-head modules ------------------------------------------------------------


def load_v2_into(head: CausalAttention, v2: SelfAttention_v2) -> None:
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            getattr(head, name).weight.copy_(getattr(v2, name).weight)


def test_causal_attention_reproduces_001_causal_weights_on_a_batch(inputs: torch.Tensor) -> None:
    """A CausalAttention head holding 001's v2 projections gives In[64]'s weights for every sequence of the batch,
    and its last context vector is v2's last one (In[58]): the last position already sees everything."""
    head = CausalAttention(3, 2, context_length=6, dropout=0.0)
    load_v2_into(head, v2_as_built_in_001())
    batch = torch.stack((inputs, inputs))  # (2, 6, 3)
    context, weights = head.attend(batch)
    assert context.shape == (2, 6, 2)
    close(weights, [V2_001_CAUSAL_WEIGHTS] * 2)
    close(context[:, -1], [V2_001_SEED_123[-1]] * 2)
    first_value = head.W_value(inputs[0]).detach()
    torch.testing.assert_close(context[:, 0].detach(), torch.stack((first_value, first_value)))  # sees only itself


def test_wrapper_concatenates_independent_heads(inputs: torch.Tensor) -> None:
    torch.manual_seed(123)
    wrapper = MultiHeadAttentionWrapper(3, 2, context_length=6, dropout=0.0, num_heads=2)
    batch = torch.stack((inputs, inputs))
    context = wrapper(batch)
    assert context.shape == (2, 6, 4)
    torch.testing.assert_close(context[..., :2], wrapper.heads[0](batch))
    torch.testing.assert_close(context[..., 2:], wrapper.heads[1](batch))


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_multi_head_attention_is_the_wrapper_with_fused_weights(inputs: torch.Tensor, qkv_bias: bool) -> None:
    """Stacking the heads' projections into one matrix and making W^O the identity turns MultiHeadAttention into
    MultiHeadAttentionWrapper: the split into heads is only a reshape."""
    torch.manual_seed(0)
    wrapper = MultiHeadAttentionWrapper(3, 2, context_length=6, dropout=0.0, num_heads=3, qkv_bias=qkv_bias)
    mha = MultiHeadAttention(3, 6, context_length=6, dropout=0.0, num_heads=3, qkv_bias=qkv_bias)
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            layers = [getattr(head, name) for head in wrapper.heads]
            getattr(mha, name).weight.copy_(torch.cat([layer.weight for layer in layers]))
            if qkv_bias:
                getattr(mha, name).bias.copy_(torch.cat([layer.bias for layer in layers]))
        mha.out_proj.weight.copy_(torch.eye(6))
        mha.out_proj.bias.zero_()
    batch = torch.stack((inputs, inputs.flip(0)))
    (wrapped, wrapper_weights), (fused, mha_weights) = wrapper.attend(batch), mha.attend(batch)
    torch.testing.assert_close(fused, wrapped)
    torch.testing.assert_close(mha_weights, wrapper_weights)


def test_multi_head_attention_is_the_models_attention() -> None:
    """The GPT's CausalSelfAttention (manual path) with the same weights gives the same output and weights."""
    torch.manual_seed(0)
    config = GPTConfig(block_size=6, n_head=2, n_embd=4, dropout=0.0, bias=True, attention="manual")
    model_attention = CausalSelfAttention(config).eval()
    mha = MultiHeadAttention(4, 4, context_length=6, dropout=0.0, num_heads=2, qkv_bias=True)
    with torch.no_grad():
        for name, w, b in zip(
            ("W_query", "W_key", "W_value"),
            model_attention.c_attn.weight.split(4),
            model_attention.c_attn.bias.split(4),
            strict=True,
        ):
            getattr(mha, name).weight.copy_(w)
            getattr(mha, name).bias.copy_(b)
        mha.out_proj.load_state_dict(model_attention.c_proj.state_dict())
    x = torch.randn(3, 6, 4)
    expected, expected_weights = model_attention(x, need_weights=True)
    actual, weights = mha.attend(x)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(weights, expected_weights)


def test_masked_steps_run_the_models_masked_attention(monkeypatch: pytest.MonkeyPatch, inputs: torch.Tensor) -> None:
    """The lab's masked step is model.attention.masked_attention itself, not a copy."""
    calls = []
    original = lab.masked_attention

    def spy(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return original(*args, **kwargs)

    monkeypatch.setattr(lab, "masked_attention", spy)
    batch = inputs.unsqueeze(0)
    torch.manual_seed(0)
    lab.causal_softmax_attention(inputs @ inputs.T, inputs)
    CausalAttention(3, 2, 6, 0.0)(batch)
    MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)(batch)
    MultiHeadAttention(3, 4, 6, 0.0, num_heads=2)(batch)
    assert calls == [(6, 6), (1, 6, 6), (1, 6, 6), (1, 6, 6), (1, 2, 6, 6)]


def test_bad_arguments_are_refused(inputs: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(3, 5, 6, 0.0, num_heads=2)
    with pytest.raises(ValueError, match="score must be one of"):
        CausalAttention(3, 2, 6, 0.0, score="cosine")
    with pytest.raises(ValueError, match="context_length 4"):
        CausalAttention(3, 2, 4, 0.0)(inputs.unsqueeze(0))


# --- Additive (Bahdanau) scoring beside the dot product ----------------------------------------------------


def test_additive_score_is_v_tanh_w1_q_plus_w2_k() -> None:
    """000 Step 1, additive scoring: score(q, k) = v^T tanh(W1 q + W2 k), checked pair by pair."""
    torch.manual_seed(0)
    head = CausalAttention(3, 2, 6, 0.0, score="additive")
    scorer = head.additive
    q, k = torch.randn(4, 2), torch.randn(5, 2)
    scores = scorer(q, k)
    assert scores.shape == (4, 5)
    W1, W2, v = scorer.W1.weight, scorer.W2.weight, scorer.v.weight.squeeze(0)
    by_hand = torch.tensor([[(v @ torch.tanh(W1 @ qi + W2 @ kj)).item() for kj in k] for qi in q])
    torch.testing.assert_close(scores, by_hand)


def make_module(kind: str, score: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "head":
        return CausalAttention(3, 4, context_length=6, dropout=0.0, score=score)
    if kind == "wrapper":
        return MultiHeadAttentionWrapper(3, 2, context_length=6, dropout=0.0, num_heads=2, score=score)
    return MultiHeadAttention(3, 4, context_length=6, dropout=0.0, num_heads=2, score=score)


@pytest.mark.parametrize("kind", ["head", "wrapper", "mha"])
@pytest.mark.parametrize("score", ["dot", "additive"])
def test_the_future_is_hidden_for_both_scores(inputs: torch.Tensor, kind: str, score: str) -> None:
    """Under the causal mask additive scoring behaves exactly like dot: future positions get weight 0.0 exactly, and
    changing the inputs after position t leaves outputs 0..t unchanged (bit for bit)."""
    module = make_module(kind, score)
    batch = torch.stack((inputs, inputs.flip(0)))  # (2, 6, 3)
    out, weights = module.attend(batch)
    future = ~lab.causal_mask(6)
    assert (weights[..., future] == 0).all()
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(weights.shape[:-1]))
    for t in range(5):
        changed = batch.clone()
        changed[:, t + 1 :] = torch.randn(2, 5 - t, 3)
        changed_out, _ = module.attend(changed)
        assert torch.equal(changed_out[:, : t + 1], out[:, : t + 1])
        assert not torch.equal(changed_out[:, t + 1 :], out[:, t + 1 :])


def test_dot_and_additive_weights_differ_but_share_the_mask(inputs: torch.Tensor) -> None:
    """The two scoring functions side by side on one head's projections: different weights, same zeros."""
    torch.manual_seed(0)
    dot = CausalAttention(3, 2, 6, 0.0, score="dot")
    additive = CausalAttention(3, 2, 6, 0.0, score="additive")
    additive.load_state_dict(dot.state_dict(), strict=False)  # same W_query, W_key, W_value; extra W1, W2, v
    batch = inputs.unsqueeze(0)
    _, dot_weights = dot.attend(batch)
    _, additive_weights = additive.attend(batch)
    assert not torch.allclose(dot_weights, additive_weights)
    torch.testing.assert_close(dot_weights == 0, additive_weights == 0)
    torch.testing.assert_close(dot_weights[..., 0, 0], additive_weights[..., 0, 0])  # both 1.0: only itself to see
