"""lab/notes.py, part 1: attention without trainable weights and with them (step by step, SelfAttention_v1 and v2,
the weight transfer), against the numbers the notes print; the causal mask and what follows it are in
test_lab_notes_causal.

The literals below are typed from the printed outputs of the attention notes the model is described in (000_* and
001_* are the notebooks with outputs; 002_*, 003_* and 004_* print no tensors). They are the reference: each test
recomputes a printed tensor with the lab and compares to the 4 decimals the notes show. Cell numbers are the
notebooks' ``In [n]``. Literals that test_lab_notes_causal uses too live in notes_numbers.
"""

from __future__ import annotations

import pytest
import torch
from notes_numbers import ALL_WEIGHTS, V2_001_SEED_123, close

from lab import notes as lab
from lab.notes import SelfAttention_v1, SelfAttention_v2, v2_as_built_in_001


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
    other: the scaled softmax of the printed scores gives the printed weights. (That w22, 1.6392, is the second
    score is a fact of the notes' printout, not of the lab: comparing the two typed numbers could not fail.)"""
    scores = torch.tensor([0.9369, 1.6392, 1.6356, 0.8910, 1.1108, 0.9853])
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
