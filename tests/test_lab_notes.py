"""The attention lab against the numbers the notes print.

The literals below are typed from the printed outputs of the attention notes the model is described in (000_* and
001_* are the notebooks with outputs; 002_*, 003_* and 004_* print no tensors). They are the reference: each test
recomputes a printed tensor with the lab and compares to the 4 decimals the notes show. Cell numbers are the
notebooks' ``In [n]``. Where the notes print nothing (dropout, the causal and multi-head modules, additive scoring)
the tests check the behaviour instead: the mask hides the future, the two multi-head forms agree, the lab runs the
model's code.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lab import notes as lab
from lab.notes import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
)
from model.attention import CausalSelfAttention
from model.config import GPTConfig

INF = float("inf")


def close(actual: torch.Tensor, expected: list | float) -> None:
    """Equal to the notes' printed value, which is rounded to 4 decimals."""
    torch.testing.assert_close(actual.detach(), torch.tensor(expected), atol=5e-5, rtol=0)


@pytest.fixture
def inputs() -> torch.Tensor:
    return lab.journey_inputs()


# --- Attention without trainable weights (000 In[26]-In[51], 001 In[18]-In[17]) ----------------------------

SCORES_JOURNEY = [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865]
SOFTMAX_JOURNEY = [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581]
CONTEXT_JOURNEY = [0.4419, 0.6515, 0.5683]

ALL_SCORES = [
    [0.9995, 0.9544, 0.9422, 0.4753, 0.4576, 0.6310],
    [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865],
    [0.9422, 1.4754, 1.4570, 0.8296, 0.7154, 1.0605],
    [0.4753, 0.8434, 0.8296, 0.4937, 0.3474, 0.6565],
    [0.4576, 0.7070, 0.7154, 0.3474, 0.6654, 0.2935],
    [0.6310, 1.0865, 1.0605, 0.6565, 0.2935, 0.9450],
]
ALL_WEIGHTS = [
    [0.2098, 0.2006, 0.1981, 0.1242, 0.1220, 0.1452],
    [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
    [0.1390, 0.2369, 0.2326, 0.1242, 0.1108, 0.1565],
    [0.1435, 0.2074, 0.2046, 0.1462, 0.1263, 0.1720],
    [0.1526, 0.1958, 0.1975, 0.1367, 0.1879, 0.1295],
    [0.1385, 0.2184, 0.2128, 0.1420, 0.0988, 0.1896],
]
ALL_CONTEXTS = [
    [0.4421, 0.5931, 0.5790],
    [0.4419, 0.6515, 0.5683],
    [0.4431, 0.6496, 0.5671],
    [0.4304, 0.6298, 0.5510],
    [0.4671, 0.5910, 0.5266],
    [0.4177, 0.6503, 0.5645],
]


def test_scores_for_journey(inputs: torch.Tensor) -> None:
    """000 In[26], 001 In[18]: x^2 ("journey") dotted with every input; 000 In[27]: the first one by hand."""
    scores = lab.attention_scores_for_query(inputs, inputs[1])
    close(scores, SCORES_JOURNEY)
    close(sum(inputs[0][i] * inputs[1][i] for i in range(3)), 0.9544)


def test_normalisations_of_journey_scores(inputs: torch.Tensor) -> None:
    """000 In[28]-In[30], 001 In[19]-In[21]: divide by the sum, the naive softmax and torch.softmax."""
    scores = lab.attention_scores_for_query(inputs, inputs[1])
    by_sum = lab.normalise_by_sum(scores)
    close(by_sum, [0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656])
    close(by_sum.sum(), 1.0)
    close(lab.softmax_naive(scores), SOFTMAX_JOURNEY)
    close(torch.softmax(scores, dim=0), SOFTMAX_JOURNEY)
    close(lab.softmax_naive(scores).sum(), 1.0)


def test_softmax_naive_overflows_where_torch_softmax_does_not() -> None:
    """Why the notes prefer torch.softmax: exp overflows to inf for large scores, and inf / inf is nan."""
    scores = torch.tensor([100.0, 101.0])
    assert torch.isnan(lab.softmax_naive(scores)).all()
    close(torch.softmax(scores, dim=0), [0.2689, 0.7311])


def test_context_vector_of_journey_and_the_wrong_index_loop(inputs: torch.Tensor) -> None:
    """z^2 = sum_i alpha_2i x^i is [0.4419, 0.6515, 0.5683]: 000 In[38] (a correct loop) and 001's ``@`` line.

    001's loop cell prints ``Context vector for x2: tensor([0.4095, 0.5534, 0.5012])``: it loops
    ``for i_, x_i in enumerate(inputs)`` but indexes ``attn_weights_2[i]``, and ``i`` is the stale loop variable of
    the score loop two cells up (In[18]), which ended at 5. So every term used alpha_26 = 0.1581, and the loop
    computed 0.1581 * (x^1 + ... + x^6) = 0.1581 * [2.59, 3.50, 3.17]. The notebook blames the gap on precision
    ("using the matrice multiplication give more accurate result") and prints the wrong vector again in In[17] as
    "Previous 2nd context vector"; it is an indexing bug, not rounding.
    """
    weights = torch.softmax(lab.attention_scores_for_query(inputs, inputs[1]), dim=0)
    close(lab.context_vector(weights, inputs), CONTEXT_JOURNEY)

    looped = torch.zeros(3)
    for i, x_i in enumerate(inputs):  # the loop with the right index
        looped += weights[i] * x_i
    close(looped, CONTEXT_JOURNEY)

    what_001_printed = weights[5] * inputs.sum(dim=0)  # the stale index, i == 5, in every term
    close(what_001_printed, [0.4095, 0.5534, 0.5012])


def test_all_scores_weights_and_context_vectors(inputs: torch.Tensor) -> None:
    """000 In[39]/In[40]/In[44]/In[51], 001 the 6x6 cells, In[15], In[17]: every query at once."""
    scores, weights, contexts = lab.simple_self_attention(inputs)
    close(scores, ALL_SCORES)
    close(weights, ALL_WEIGHTS)
    close(weights.sum(dim=-1), [1.0] * 6)
    close(contexts, ALL_CONTEXTS)
    looped = torch.tensor([[torch.dot(x_i, x_j).item() for x_j in inputs] for x_i in inputs])
    close(looped, ALL_SCORES)


# --- Trainable weights, step by step (000 In[60]-In[71]; 001 In[27]-In[34]) --------------------------------


def test_trainable_attention_for_journey_seed_123(inputs: torch.Tensor) -> None:
    """000 In[60]-In[71]: torch.manual_seed(123), then W_query, W_key, W_value = torch.rand(3, 2) in that order
    (the same draws SelfAttention_v1 makes); query, score w22, scores, weights and context vector of "journey"."""
    torch.manual_seed(123)
    v1 = SelfAttention_v1(3, 2)
    step = lab.trainable_attention_for_query(inputs[1], inputs, v1.W_query, v1.W_key, v1.W_value)
    close(step.query, [0.4306, 1.4551])
    close(step.scores[1], 1.8524)  # w22 = q^2 . k^2
    close(step.scores, [1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440])
    close(step.weights, [0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820])
    close(step.context, [0.3061, 0.8210])


def test_unseeded_trainable_numbers_of_001_are_consistent() -> None:
    """001 In[27] draws W_query, W_key, W_value without a seed, so its q^2 = [1.0747, 1.3278] and the context
    vector [1.1735, 0.6411] cannot be reproduced. What can be checked is that the printed steps follow from each
    other: w22 is the second score, and the scaled softmax of the printed scores gives the printed weights."""
    scores = torch.tensor([0.9369, 1.6392, 1.6356, 0.8910, 1.1108, 0.9853])
    close(scores[1], 1.6392)
    close(lab.scaled_attention_weights(scores, d_k=2), [0.1348, 0.2216, 0.2210, 0.1305, 0.1525, 0.1395])


# --- SelfAttention_v1 / v2 and the weight transfer ---------------------------------------------------------

V1_SEED_123 = [
    [0.2996, 0.8053],
    [0.3061, 0.8210],
    [0.3058, 0.8203],
    [0.2948, 0.7939],
    [0.2927, 0.7891],
    [0.2990, 0.8040],
]
V2_SEED_789 = [
    [-0.0739, 0.0713],
    [-0.0748, 0.0703],
    [-0.0749, 0.0702],
    [-0.0760, 0.0685],
    [-0.0763, 0.0679],
    [-0.0754, 0.0693],
]
V1_THEN_V2_SEED_789 = [
    [0.3671, -0.3086],
    [0.3675, -0.3095],
    [0.3675, -0.3094],
    [0.3670, -0.3073],
    [0.3670, -0.3061],
    [0.3672, -0.3085],
]
V2_001_SEED_123 = [
    [-0.6433, 0.1075],
    [-0.6464, 0.1035],
    [-0.6464, 0.1035],
    [-0.6443, 0.1024],
    [-0.6449, 0.1029],
    [-0.6445, 0.1027],
]


def v2_as_built_in_001(seed: int = 123) -> SelfAttention_v2:
    """001's SelfAttention_v2 builds its layers key, value, query (the lab and 000 build query, key, value), and the
    order decides which draws each layer gets: rebuild 001's draws and load them into the lab's class."""
    torch.manual_seed(seed)
    key, value, query = (nn.Linear(3, 2, bias=False) for _ in range(3))
    v2 = SelfAttention_v2(3, 2)
    with torch.no_grad():
        for name, layer in (("W_query", query), ("W_key", key), ("W_value", value)):
            getattr(v2, name).weight.copy_(layer.weight)
    return v2


def test_self_attention_v1_seed_123(inputs: torch.Tensor) -> None:
    """000 In[114] and 001 In[36]: torch.manual_seed(123); SelfAttention_v1(3, 2)(inputs). Its second row is the
    step-by-step context vector of "journey" (000 In[71])."""
    torch.manual_seed(123)
    close(SelfAttention_v1(3, 2)(inputs), V1_SEED_123)
    # An explicit generator seeded the same way makes the same draws without touching the global one.
    close(SelfAttention_v1(3, 2, generator=torch.Generator().manual_seed(123))(inputs), V1_SEED_123)


def test_self_attention_v2_seed_789(inputs: torch.Tensor) -> None:
    """000 In[124]: torch.manual_seed(789); SelfAttention_v2(3, 2)(inputs)."""
    torch.manual_seed(789)
    close(SelfAttention_v2(3, 2)(inputs), V2_SEED_789)


def test_weight_transfer_v1_then_v2_seed_789(inputs: torch.Tensor) -> None:
    """000 In[128] (exercise 3.1): after torch.manual_seed(789) the v1 is built first, so v2 gets later draws
    than in In[124]; after the transfer both print the same matrix."""
    torch.manual_seed(789)
    v1 = SelfAttention_v1(3, 2)
    v2 = SelfAttention_v2(3, 2)
    lab.copy_v2_weights_into_v1(v1, v2)
    close(v1(inputs), V1_THEN_V2_SEED_789)
    close(v2(inputs), V1_THEN_V2_SEED_789)


def test_weight_transfer_of_001(inputs: torch.Tensor) -> None:
    """001 In[58]: v2 after torch.manual_seed(123) (key, value, query order), then its weights moved into the v1
    of In[36]: the same matrix twice."""
    torch.manual_seed(123)
    v1 = SelfAttention_v1(3, 2)
    v2 = v2_as_built_in_001()
    close(v2(inputs), V2_001_SEED_123)
    lab.copy_v2_weights_into_v1(v1, v2)
    close(v1(inputs), V2_001_SEED_123)


def test_weight_transfer_refuses_a_bias() -> None:
    with pytest.raises(ValueError, match="no bias"):
        lab.copy_v2_weights_into_v1(SelfAttention_v1(3, 2), SelfAttention_v2(3, 2, qkv_bias=True))


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
