"""Tiny models and data used across the course.

They are small on purpose: every notebook must run on a 2-core laptop CPU. They teach the
mechanism; a parameter cell in each notebook scales them up for GPU demos.

* ``TinyMLP``       -- a stack of Linear+GELU layers (data parallel, mixed precision, accumulation).
* ``TinyGPT``       -- a nanoGPT-style decoder-only transformer (``n_layer``, ``n_head``, ``n_embd``);
  ``attention="sdpa"`` swaps the written-out attention for PyTorch's fused kernel (:data:`ATTENTION`).
* ``causal_attention`` -- that written-out attention on ``q, k, v``, the one the course's tensor-parallel
  (notebook 07) and recomputing (notebook 11) blocks run too.
* ``make_regression`` / ``make_tokens`` -- seeded synthetic data.
* ``SleepLayer``    -- *emulated* compute for timing experiments (notebook 08): it sleeps a set time
  forward and backward, so a pipeline's timeline does not depend on how many CPU cores are free.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyMLP(nn.Module):
    """``n_layers`` Linear layers with GELU between them (and dropout after each GELU when
    ``dropout > 0``: training then draws from torch's RNG, which notebook 12 must checkpoint).

    Shapes: input ``(B, d_in)`` -> output ``(B, d_out)``.
    """

    def __init__(self, d_in: int = 16, d_hidden: int = 64, d_out: int = 1, n_layers: int = 3,
                 dropout: float = 0.0):
        super().__init__()
        if min(d_in, d_hidden, d_out) < 1 or n_layers < 1:
            raise ValueError(
                f"TinyMLP sizes must be positive (got d_in={d_in}, d_hidden={d_hidden}, "
                f"d_out={d_out}, n_layers={n_layers})"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"TinyMLP dropout must be in [0, 1), got {dropout!r}")
        self.dropout = float(dropout)
        dims = [d_in] + [d_hidden] * (n_layers - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
                if self.dropout:
                    x = F.dropout(x, self.dropout, self.training)
        return x


def make_regression(n: int = 256, d_in: int = 16, d_out: int = 1, seed: int = 0, noise: float = 0.1,
                    device: torch.device | str | None = None):
    """A seeded linear-regression data set ``(X, y)`` with ``X: (n, d_in)``, ``y: (n, d_out)``, on
    ``device`` (``None``: torch's default device, the CPU unless a rank set it, as
    ``Cluster(backend="nccl")`` does). Drawn on the CPU, so the values are the same on every device."""
    device = torch.get_default_device() if device is None else device
    g = torch.Generator(device="cpu").manual_seed(seed)
    X = torch.randn(n, d_in, generator=g, device="cpu")
    w = torch.randn(d_in, d_out, generator=g, device="cpu")
    y = X @ w + noise * torch.randn(n, d_out, generator=g, device="cpu")
    return X.to(device), y.to(device)


#: How :class:`CausalSelfAttention` computes ``softmax(Q K^T / sqrt(head_dim) + causal mask) V``:
#: ``"course"`` writes it out (:func:`causal_attention`), ``"sdpa"`` calls ``F.scaled_dot_product_attention``
#: (same maths).
ATTENTION = ("course", "sdpa")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                     training: bool = True) -> torch.Tensor:
    """``dropout(softmax(mask(q k^T / sqrt(d)))) @ v`` with the causal mask, written out: the
    ``(B, a, s, s)`` score matrix is materialised, masked, soft-maxed and saved for the backward, the
    way the notebooks count its FLOPs and bytes. ``q, k, v``: ``(B, a, s, d)`` (``a`` heads, or a rank's
    share of them); returns ``(B, a, s, d)``.

    Dropout on the probabilities (``dropout_p``, when ``training``; ``F.dropout`` with ``p = 0`` returns
    its input) is :class:`course_lib.recompute.TransformerBlock`'s; :class:`CausalSelfAttention` and
    :class:`course_lib.tensor_parallel.ParallelSelfAttention` have none. This is the part of attention
    whose saved tensors grow with ``s^2`` (Korthikanti et al. 2022, §4.1: the ``5as/h`` term of Eq. 1),
    the part selective recomputation re-runs (§5, notebook 11).
    """
    s, d = q.shape[-2], q.shape[-1]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(d)                       # (B, a, s, s)
    att = att.masked_fill(~torch.ones(s, s, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    att = F.dropout(att.softmax(dim=-1), dropout_p, training)
    return att @ v                                                        # (B, a, s, d)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused QKV projection, one output projection.

    ``attention`` chooses how the heads are computed; the parameters and the function are the same:

    * ``"course"`` (default): written out, the way the notebooks count its FLOPs and bytes: the
      ``(B, n_head, T, T)`` score matrix is materialised, masked, soft-maxed and saved for the backward;
    * ``"sdpa"``: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``, PyTorch's fused kernel
      (FlashAttention or memory-efficient attention on a GPU), which never stores the score matrix.
      ``benchmarks/bench_gpu.py`` measures the difference in MFU and memory.
    """

    def __init__(self, n_embd: int, n_head: int, attention: str = "course"):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r} is not one of {ATTENTION}: 'course' writes the "
                             f"softmax out, 'sdpa' calls F.scaled_dot_product_attention")
        self.n_head, self.attention = n_head, attention
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, n_head, T, head_dim)
        else:
            y = causal_attention(q, k, v)  # (B, n_head, T, head_dim)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.proj(y)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) with a 4x MLP.
    ``attention``: see :class:`CausalSelfAttention`."""

    def __init__(self, n_embd: int, n_head: int, attention: str = "course"):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, attention)
        self.ln2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A decoder-only transformer in the style of nanoGPT (Radford et al. 2019, GPT-2).

    Shapes: token ids ``(B, T)`` -> logits ``(B, T, vocab_size)``. The LM head is tied to the
    token embedding, as in GPT-2. ``attention``: ``"course"`` (default) or ``"sdpa"``, see
    :class:`CausalSelfAttention`; GPT-2 small is ``TinyGPT(50257, 1024, 12, 12, 768)``.
    """

    def __init__(self, vocab_size: int = 64, block_size: int = 32, n_layer: int = 2,
                 n_head: int = 2, n_embd: int = 32, attention: str = "course"):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, attention) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, n_embd)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab_size)


def make_tokens(n: int = 64, block_size: int = 32, vocab_size: int = 64, seed: int = 0,
                device: torch.device | str | None = None):
    """Seeded next-token data ``(x, y)``, both ``(n, block_size)``: a noisy counting sequence
    (each token is the previous one plus one, modulo ``vocab_size``), learnable by a tiny GPT. On
    ``device`` as :func:`make_regression` (drawn on the CPU: the same tokens on every device)."""
    device = torch.get_default_device() if device is None else device
    g = torch.Generator(device="cpu").manual_seed(seed)
    start = torch.randint(0, vocab_size, (n, 1), generator=g, device="cpu")
    seq = (start + torch.arange(block_size + 1, device="cpu")) % vocab_size  # (n, block_size + 1)
    return seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)


class _SleepInput(torch.autograd.Function):
    """y = x * gain (gain a plain number here); forward sleeps, backward sleeps and returns dx only."""

    @staticmethod
    def forward(ctx, x, gain, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.gain, ctx.backward_s = gain, backward_s
        return x * gain

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad * ctx.gain, None, None, None


class _SleepWeight(torch.autograd.Function):
    """Zero forward; backward sleeps and returns the gradient of ``gain`` in y = x * gain."""

    @staticmethod
    def forward(ctx, x, gain, backward_s):
        ctx.save_for_backward(x)
        ctx.backward_s = backward_s
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        x, = ctx.saved_tensors
        return None, (grad * x).sum().reshape(1), None


class SleepLayer(nn.Module):
    """Emulated compute: ``y = gain * x`` (``gain`` a 1-element parameter, 1 at first) that *sleeps*
    ``forward_s`` seconds in the forward and ``backward_s`` (default ``2 * forward_s``) in the backward.

    Timing experiments on a laptop CPU are distorted when several ranks share few cores; a sleeping
    rank uses no core, so a pipeline of SleepLayers shows the schedule's own timing (notebook 08 says
    so where it uses them). The backward has two halves, so a split backward (zero-bubble schedules)
    can run them apart: the input gradient (``(1 - weight_share) * backward_s``, through ``x``) and the
    weight gradient (``weight_share * backward_s``, into ``gain``; it reads ``x``, not the upstream
    layers, so it is the only node on the path to the parameter). When ``x`` needs no gradient (the
    first layer of a model), the weight half sleeps the whole ``backward_s``.
    """

    def __init__(self, forward_s: float, backward_s: float | None = None, weight_share: float = 0.5):
        super().__init__()
        backward_s = 2.0 * forward_s if backward_s is None else backward_s
        if not (forward_s >= 0 and backward_s >= 0 and 0 <= weight_share <= 1):
            raise ValueError(f"SleepLayer needs forward_s >= 0, backward_s >= 0 and 0 <= weight_share <= 1, "
                             f"got {forward_s}, {backward_s}, {weight_share}")
        self.forward_s, self.backward_s, self.weight_share = float(forward_s), float(backward_s), weight_share
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = float(self.gain.detach())
        input_s, weight_s = (1 - self.weight_share) * self.backward_s, self.weight_share * self.backward_s
        if not x.requires_grad:  # autograd will not run the input half: its time goes to the weight half
            time.sleep(self.forward_s)
            return x * g + _SleepWeight.apply(x.detach(), self.gain, input_s + weight_s)
        y = _SleepInput.apply(x, g, self.forward_s, input_s)
        return y + _SleepWeight.apply(x.detach(), self.gain, weight_s)

    def extra_repr(self) -> str:
        return f"forward_s={self.forward_s}, backward_s={self.backward_s}, weight_share={self.weight_share}"
