"""What both lab-notes test files compare with: the notes' 4-decimal rounding and two of the tensors they print
(test_lab_notes: attention without and with trainable weights; test_lab_notes_causal: the causal mask, dropout, the
multi-head modules and additive scoring). 001's SelfAttention_v2 is rebuilt by lab.notes.v2_as_built_in_001."""

from __future__ import annotations

import torch


def close(actual: torch.Tensor, expected: list | float) -> None:
    """Equal to the notes' printed value, which is rounded to 4 decimals."""
    torch.testing.assert_close(actual.detach(), torch.tensor(expected), atol=5e-5, rtol=0)


# The attention weights of every query without trainable weights (test_all_scores_weights_and_context_vectors).
ALL_WEIGHTS = [
    [0.2098, 0.2006, 0.1981, 0.1242, 0.1220, 0.1452],
    [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
    [0.1390, 0.2369, 0.2326, 0.1242, 0.1108, 0.1565],
    [0.1435, 0.2074, 0.2046, 0.1462, 0.1263, 0.1720],
    [0.1526, 0.1958, 0.1975, 0.1367, 0.1879, 0.1295],
    [0.1385, 0.2184, 0.2128, 0.1420, 0.0988, 0.1896],
]


# 001 In[58]: SelfAttention_v2 built after torch.manual_seed(123) in 001's layer order (v2_as_built_in_001).
V2_001_SEED_123 = [
    [-0.6433, 0.1075],
    [-0.6464, 0.1035],
    [-0.6464, 0.1035],
    [-0.6443, 0.1024],
    [-0.6449, 0.1029],
    [-0.6445, 0.1027],
]
