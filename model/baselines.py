"""The models attention is measured against: a bigram table (each character predicts the next from itself alone), a
GRU and an LSTM (recurrent models that squeeze the whole past into one hidden state, the bottleneck the notes
describe; the LSTM is the notes' "before attention" model, with a cell state beside the hidden one). All keep the
GPT's interface: ``logits, loss = model(idx, targets)``, ``generate``, ``num_params``, ``flops_per_token``, so
train.py, sample.py and checkpoints treat every type alike."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .gpt import GPT, check_request, check_sampling, sample_next


class Recurrent(nn.Module):
    """What the two baselines share: the loss, and sampling one character at a time from a carried state."""

    config: GPTConfig

    def step(self, idx: torch.Tensor, state: object) -> tuple[torch.Tensor, object]:
        """Logits (B, T, vocab) for idx (B, T), continuing from state (None: from nothing); and the new state."""
        raise NotImplementedError

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, return_attention: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if return_attention:
            raise ValueError(f"a {self.config.type} model has no attention to return")
        logits, _ = self.step(idx, None)  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def num_params(self, non_embedding: bool = True) -> int:
        return sum(p.numel() for p in self.parameters())

    def generate_iter(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                      top_k: int | None = None, top_p: float | None = None, generator: torch.Generator | None = None,
                      use_cache: bool = True, keep: int | None = None) -> Iterator[torch.Tensor]:
        """Yield the next (B, 1) ids one at a time. The prompt's last block_size characters set the state, which
        then carries on from character to character (use_cache and keep are the GPT's and change nothing here). The
        arguments are checked as GPT.generate_iter checks them, when it is called."""
        check_request(idx, max_new_tokens)
        check_sampling(temperature, top_k, top_p)
        return self._generate_iter(idx, max_new_tokens, temperature, top_k, top_p, generator)

    @torch.inference_mode()
    def _generate_iter(self, idx: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int | None,
                       top_p: float | None, generator: torch.Generator | None) -> Iterator[torch.Tensor]:
        logits, state = self.step(idx[:, -self.config.block_size :], None)
        for _ in range(max_new_tokens):
            next_id = sample_next(logits[:, -1, :].float(), temperature, top_k, top_p, generator)  # (B, 1)
            yield next_id
            logits, state = self.step(next_id, state)

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, generator: torch.Generator | None = None, use_cache: bool = True,
                 keep: int | None = None) -> torch.Tensor:
        """Continue idx (B, T) by max_new_tokens characters; returns (B, T + max_new_tokens)."""
        steps = self.generate_iter(idx, max_new_tokens, temperature, top_k, top_p, generator)
        if max_new_tokens == 0:
            return idx
        return torch.cat([idx, *steps], dim=1)


class Bigram(Recurrent):
    """A (vocab, vocab) table: row c holds the logits of the character after c. The char-LM baseline."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.vocab_size < 1:
            raise ValueError("GPTConfig.vocab_size must be set (>= 1) to build a model")
        self.config = config
        self.table = nn.Embedding(config.vocab_size, config.vocab_size)
        nn.init.normal_(self.table.weight, mean=0.0, std=0.02)

    def step(self, idx: torch.Tensor, state: object) -> tuple[torch.Tensor, object]:
        return self.table(idx), None  # (B, T, vocab): no state, each character alone

    def flops_per_token(self) -> float:
        """None of a matrix multiply: a lookup. (MFU reads 0 for a bigram model.)"""
        return 0.0


class RecurrentNet(Recurrent):
    """Embedding, n_layer recurrent layers of width n_embd (``LAYER``: PyTorch's GRU or LSTM), layer norm, a linear
    head tied to the embedding. The layers are kept under the type's name (``self.gru``, ``self.lstm``), which names
    their weights in checkpoints."""

    LAYER: type[nn.RNNBase]
    GATES: int  # the input and hidden matrices a layer has per gate: 3 (GRU) or 4 (LSTM)

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.vocab_size < 1:
            raise ValueError("GPTConfig.vocab_size must be set (>= 1) to build a model")
        self.config = config
        C = config.n_embd
        self.wte = nn.Embedding(config.vocab_size, C)
        self.drop = nn.Dropout(config.dropout)
        layers = self.LAYER(C, C, num_layers=config.n_layer, batch_first=True, bias=config.bias,
                            dropout=config.dropout if config.n_layer > 1 else 0.0)
        setattr(self, config.type, layers)
        self.ln_f = nn.LayerNorm(C, bias=config.bias)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in the GPT
        nn.init.normal_(self.wte.weight, mean=0.0, std=0.02)
        for name, p in layers.named_parameters():
            if name.startswith("weight"):
                nn.init.uniform_(p, -1 / math.sqrt(C), 1 / math.sqrt(C))

    def step(self, idx: torch.Tensor, state: object) -> tuple[torch.Tensor, object]:
        x = self.drop(self.wte(idx))  # (B, T, C)
        # (B, T, C); state (n_layer, B, C), with the LSTM's cell state beside it: all of the past, squeezed
        h, state = getattr(self, self.config.type)(x, state)
        return self.lm_head(self.ln_f(h)), state

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per weight of the layers' input and hidden matrices (one pair a gate) and of
        the head."""
        C, L, V = self.config.n_embd, self.config.n_layer, self.config.vocab_size
        return 6 * (L * 2 * self.GATES * C * C + V * C)


class GRUModel(RecurrentNet):
    """model.type=gru: GRU layers (reset and update gates, and the candidate state)."""

    LAYER, GATES = nn.GRU, 3


class LSTMModel(RecurrentNet):
    """model.type=lstm: LSTM layers (input, forget and output gates, and the cell's candidate)."""

    LAYER, GATES = nn.LSTM, 4


def build_model(config: GPTConfig) -> nn.Module:
    """The model config.type names: GPT, Bigram, GRUModel or LSTMModel."""
    return {"gpt": GPT, "bigram": Bigram, "gru": GRUModel, "lstm": LSTMModel}[config.type](config)
