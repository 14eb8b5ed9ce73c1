"""The GPT of the notes: embeddings, masked self-attention blocks, a linear head over the characters."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .attention import CausalSelfAttention, KVCache
from .config import GPTConfig
from .linear import Linear


class NonFiniteLogits(ArithmeticError):
    """The model's next-character logits are not all finite numbers, so there is no distribution to draw from: its
    weights are finite but so large that float32 overflows in the forward pass. Every sampling path raises it at the
    first such character, having yielded the ones before."""

    def __init__(self) -> None:
        super().__init__("the model's output is not a finite number (its weights are so large that float32 overflows)")


class MLP(nn.Module):
    """The feed-forward layer: widen 4x, GELU, project back."""

    # The compiled training step's own GELU (training/gelu_kernel.py) and a digest of its code, where it applies (a
    # CPU, float32); None where torch's runs. kernel_eager: the eager training step runs it too.
    kernel: Callable[[torch.Tensor], torch.Tensor] | None = None
    kernel_source = ""
    kernel_eager = False

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        return self.dropout(self.c_proj(self.kernel(h) if self.takes_kernel(h) else self.gelu(h)))

    def takes_kernel(self, h: torch.Tensor) -> bool:
        """Whether this pass runs the training step's GELU (see kernel): only where the step is traced (or eager,
        with kernel_eager), computing gradients, in float32 on the CPU."""
        return (self.kernel is not None and (self.kernel_eager or torch.compiler.is_compiling())
                and torch.is_grad_enabled()
                and h.dtype == torch.float32 and h.device.type == "cpu")


class Block(nn.Module):
    """Transformer block. Pre-norm (model.norm=pre, GPT-2's): x + attn(ln_1(x)), then x + mlp(ln_2(x)). Post-norm
    (model.norm=post, the notes' Add & Norm): ln_1(x + attn(x)), then ln_2(x + mlp(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        self.post = config.norm == "post"

    def attn_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the attention projects: ln_1(x) pre-norm, x itself post-norm."""
        return x if self.post else self.ln_1(x)

    def add_attention(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The residual sum with the attention's output a (and post-norm its layer norm)."""
        return self.ln_1(x + a) if self.post else x + a

    def add_mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward layer with its residual sum and layer norm, where model.norm puts it."""
        return self.ln_2(x + self.mlp(x)) if self.post else x + self.mlp(self.ln_2(x))

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0, need_weights: bool = False,
        qkv: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """qkv: the attention's projections of attn_input(x), where the caller has them (GPT.first_projections)."""
        a, weights = self.attn(self.attn_input(x) if qkv is None else x, cache, layer, need_weights, qkv)
        return self.add_mlp(self.add_attention(x, a)), weights

    def forward_at(self, x: torch.Tensor, row: torch.Tensor | None = None, qkv: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """The block's output (B, 1, C) at position row (a (1,) index; None: the last) alone; see
        CausalSelfAttention.forward_at."""
        here = x[:, -1:] if row is None else x.index_select(1, row)
        return self.add_mlp(self.add_attention(here, self.attn.forward_at(self.attn_input(x) if qkv is None else x,
                                                                           row, qkv)))


class GPT(nn.Module):
    """Decoder-only character-level transformer.

    ``logits, loss = model(idx, targets)``: idx and targets are (B, T) character ids with T <= block_size;
    logits are (B, T, vocab_size); loss is the mean cross-entropy, or None without targets.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.vocab_size < 1:
            raise ValueError("GPTConfig.vocab_size must be set (>= 1) to build a model")
        self.config = config
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.n_embd),  # token embeddings
            "wpe": nn.Embedding(config.block_size, config.n_embd),  # learned position embeddings
            "drop": nn.Dropout(config.dropout),
            "h": nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            # post-norm, each block's output is already normalised: no last layer norm (the first transformer's)
            "ln_f": nn.LayerNorm(config.n_embd, bias=config.bias) if config.norm == "pre" else nn.Identity(),
        })
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: the head reads characters out with the same vectors that embed them.
        self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled so the residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the position embeddings (the token ones are the tied head)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per weight of every matrix multiply (2 forward, 4 backward), including the
        tied output head, plus attention's scores and weighted sums (2 * 2 * T * C forward per layer, times 3)."""
        C, L, T = self.config.n_embd, self.config.n_layer, self.config.block_size
        matrix_weights = L * 12 * C * C + self.config.vocab_size * C  # q/k/v, projection, MLP in and out; the head
        return 6 * matrix_weights + 12 * L * T * C

    def embed(self, idx: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Token plus learned position embeddings (B, T, C) of idx (B, T), its first position at offset."""
        pos = torch.arange(offset, offset + idx.size(1), device=idx.device)  # (T,)
        return self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))

    def hidden(
        self, idx: torch.Tensor, cache: KVCache | None = None, need_weights: bool = False
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final-layer-norm states (B, T, C) and, if asked, each layer's attention weights (B, nh, T, Tk)."""
        T = idx.size(1)
        offset = cache.length if cache is not None else 0
        if offset + T > self.config.block_size:
            raise ValueError(f"sequence of {offset + T} exceeds block_size {self.config.block_size}")
        x = self.embed(idx, offset)
        all_weights = []
        for layer, block in enumerate(self.transformer.h):
            x, weights = block(x, cache, layer, need_weights)
            if need_weights:
                all_weights.append(weights)
        if cache is not None:
            cache.length += T
        return self.transformer.ln_f(x), all_weights

    def hidden_at(self, idx: torch.Tensor, row: torch.Tensor | None = None, first: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """The final-layer-norm state (B, C) of position row (a (1,) index; None: the last) of idx (B, T), as hidden()
        gives it, with less work: the last layer runs its attention query, projection and MLP for that one position
        only, and with first (first_projections(), in eval mode) the first block looks its projections up."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} exceeds block_size {self.config.block_size}")
        x = self.embed(idx)
        # (B, T, 3C): each character's row of the table at its position
        qkv = None if first is None else first[idx, torch.arange(T, device=idx.device)]
        *blocks, last = self.transformer.h
        for block in blocks:
            x, _ = block(x, qkv=qkv)
            qkv = None
        return self.transformer.ln_f(last.forward_at(x, row, qkv)).squeeze(1)

    @torch.no_grad()
    def first_projections(self) -> torch.Tensor:
        """The first block's attention projections, c_attn(attn_input(wte[c] + wpe[p])), of every character c at every
        position p: (vocab_size, block_size, 3 * n_embd). The first block's input is a function of the character and
        its position alone, so where dropout is off (eval mode) its projections can be looked up instead of computed:
        sampling's window (model.sampler) does, a snapshot of the weights of the moment."""
        wte, wpe = self.transformer.wte.weight, self.transformer.wpe.weight
        first = self.transformer.h[0]
        return first.attn.c_attn(first.attn_input(wte[:, None, :] + wpe[None, :, :]))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, return_attention: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        x, weights = self.hidden(idx, need_weights=return_attention)
        logits = self.lm_head(x)  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        if return_attention:
            return logits, loss, weights
        return logits, loss

    def generate_iter(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        keep: int | None = None,
    ) -> Iterator[torch.Tensor]:
        """Yield the next (B, 1) character ids one at a time; see ``generate``. The arguments are checked here, when
        it is called, not at the first character."""
        check_request(idx, max_new_tokens)
        check_sampling(temperature, top_k, top_p)
        block_size = self.config.block_size
        keep = block_size - 1 if keep is None else keep
        # A window of one character (block_size 1) keeps nothing of the old window: keep is 0, its only value.
        lowest = min(1, block_size - 1)
        if not lowest <= keep < block_size:
            raise ValueError(f"keep must be in [{lowest}, block_size - 1] = [{lowest}, {block_size - 1}], got {keep}")
        return self._generate_iter(idx, max_new_tokens, temperature, top_k, top_p, generator, use_cache, keep)

    @torch.inference_mode()
    def _generate_iter(self, idx: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int | None,
                       top_p: float | None, generator: torch.Generator | None, use_cache: bool, keep: int
                       ) -> Iterator[torch.Tensor]:
        block_size = self.config.block_size
        B, T = idx.shape
        context = torch.empty(B, T + max_new_tokens, dtype=idx.dtype, device=idx.device)
        context[:, :T] = idx
        start = max(0, T - block_size)  # the window the model sees is context[:, start:end]
        cache = KVCache(self.config, B, idx.device, self.lm_head.weight.dtype) if use_cache else None
        for end in range(T, T + max_new_tokens):
            if end - start > block_size:  # full: keep its last `keep` characters and the newest one
                start = end - keep - 1
            if cache is None:
                x, _ = self.hidden(context[:, start:end])
            elif cache.length == 0 or start != end - 1 - cache.length:
                # Learned positions: when the window moves, every position in it shifts, so the cached keys and
                # values are stale and the window is computed afresh (at most block_size positions).
                cache.reset()
                x, _ = self.hidden(context[:, start:end], cache)
            else:
                x, _ = self.hidden(context[:, end - 1 : end], cache)
            logits = self.lm_head(x[:, -1, :]).float()  # (B, vocab)
            next_id = sample_next(logits, temperature, top_k, top_p, generator)  # (B, 1)
            context[:, end : end + 1] = next_id
            yield next_id

    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        keep: int | None = None,
    ) -> torch.Tensor:
        """Continue idx (B, T) by max_new_tokens characters; returns (B, T + max_new_tokens).

        The model sees at most block_size characters, so generation may run past block_size. By default the
        window slides by one character, so every prediction sees the last block_size characters (as nanoGPT
        does); once the window is full that costs a forward pass over block_size positions per character,
        because learned positions shift and the KV cache cannot be reused. ``keep`` < block_size - 1 lets the
        window jump instead: when it is full, only its last ``keep`` characters are kept, and the cache serves
        the next block_size - keep characters (much faster; each prediction then sees at least ``keep``). With
        block_size 1 the window is the newest character alone, and keep is 0.

        temperature 0 is greedy decoding; top_k keeps the k likeliest characters, top_p the smallest set whose
        probability reaches p. The KV cache changes only the speed, never the characters.
        """
        steps = self.generate_iter(idx, max_new_tokens, temperature, top_k, top_p, generator, use_cache, keep)
        if max_new_tokens == 0:
            return idx
        return torch.cat([idx, *steps], dim=1)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError naming the argument, by the rules sample.py applies to its options: a negative temperature would
    sample the unlikeliest characters, a NaN one decode greedily, and top_k 0 or top_p 0 keep no character."""
    if not temperature >= 0 or temperature == math.inf:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and not top_k >= 1:
        raise ValueError(f"top_k must be >= 1 (or None: every character), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (or None: every character), got {top_p}")


def check_request(idx: torch.Tensor, max_new_tokens: int) -> None:
    """ValueError naming the argument unless idx is (B, T) ids with at least one character a row (the model predicts
    from the last one) and max_new_tokens is >= 0."""
    if idx.dim() != 2 or idx.size(1) < 1:
        raise ValueError(f"idx must be (batch, length) ids with a length of at least 1, got shape {tuple(idx.shape)}")
    if not max_new_tokens >= 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one id per row of logits (B, vocab) -> (B, 1); NonFiniteLogits if any of them is not a finite number."""
    if not torch.isfinite(logits).all():
        raise NonFiniteLogits()
    if temperature == 0.0:
        return logits.argmax(dim=-1, keepdim=True)
    scaled = logits / temperature
    if not torch.isfinite(scaled).all():  # checked first: the fixed-shape window always takes the same rows
        scaled = greedy_where_overflowed(scaled, logits)
    return torch.multinomial(filtered_probs(scaled, top_k, top_p, logits), num_samples=1, generator=generator)


def greedy_where_overflowed(scaled: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """scaled (B, vocab), logits / temperature, with each row whose largest value overflowed float32 (a temperature
    near 0 such as 1e-40, or logits near float32's limit, 1e36 at temperature 1e-3) made its likeliest character
    alone: 0 there, -inf elsewhere. Such a row's softmax would be NaN; to the precision of its logits it is greedy.
    The row is still drawn from (a one-hot draw), so that every path moves the generator alike: the fixed-shape window
    draws each character's noise before it knows the logits (model.sampler), and greedy rows that skipped the draw
    made the plain path's later characters differ from its. Branch-free, for compiled code and CUDA graphs."""
    # By the row's largest value: the softmax subtracts it, so a row whose unlikely characters alone fell to -inf
    # (a logit of -3e38 at temperature 0.5) is drawn from as it is, with those at 0; it was made greedy too
    overflowed = ~torch.isfinite(scaled.amax(dim=-1, keepdim=True))  # (B, 1): +inf, or every value -inf
    alone = torch.full_like(scaled, float("-inf")).scatter(-1, logits.argmax(dim=-1, keepdim=True), 0.0)
    return torch.where(overflowed, alone, scaled)


def filtered_probs(scaled: torch.Tensor, top_k: int | None, top_p: float | None,
                   logits: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax of temperature-scaled logits (B, vocab), keeping the top_k likeliest characters and then the
    smallest set whose probability reaches top_p. Which characters are the likeliest is read from logits, the
    unscaled ones, where given: at a huge temperature the scaled ones round to equal values (every one 0 past
    float32's range, or softmax weights all 1.0 past about 1e8), and top_k 1 drew from every character."""
    ranked = scaled if logits is None else logits
    if top_k is not None and top_k < scaled.size(-1):
        kth = torch.topk(ranked, top_k, dim=-1).values[:, -1:]  # (B, 1)
        scaled = scaled.masked_fill(ranked < kth, float("-inf"))
    probs = F.softmax(scaled, dim=-1)
    if top_p is not None and top_p < 1.0:
        order = torch.sort(ranked, dim=-1, descending=True).indices
        sorted_probs = probs.gather(-1, order)
        # keep a character while the mass before it is below top_p; the first, likeliest one always: a top_p under
        # float32's smallest value (1e-46) rounds to 0 in the comparison, which would drop it too and leave nothing
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop[..., 0] = False
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs
