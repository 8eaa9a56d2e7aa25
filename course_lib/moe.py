"""Mixture of experts from scratch: a router, top-k dispatch with capacity, and expert parallelism.

A mixture-of-experts (MoE) layer replaces a transformer block's one feed-forward network (FFN) by
``E`` expert FFNs and a *router* (gating network, Shazeer et al. 2017) that sends each token to its
``k`` best experts (``k = 1``: Switch Transformer, Fedus et al. 2021; ``k = 2``: GShard, Lepikhin et
al. 2020, and Mixtral, Jiang et al. 2024). The parameters grow ``E`` times; the FLOPs per token grow
only ``k`` times (plus the router's ``h E``).

::

    tokens x (T, h) --router--> probs (T, E) --top-k--> expert ids (T, k), weights (T, k)
         |                                                   |
         +--dispatch: each expert gets its tokens, at most C of them (C = capacity)
         |        expert e: FFN_e(x[tokens of e])            (T_e <= C, h) -> (T_e, h)
         +--combine: y_t = sum over the token's k choices of weight * FFN_e(x_t)
            a token an expert had no room for gets nothing from it: the block's residual carries it

Pieces: :func:`route` (softmax, top-k, normalising the k weights or not, optional noise; in fp32
whatever the model's dtype), :func:`load_balancing_loss` (Switch's ``alpha E sum_i f_i P_i``, ``f`` over
the local micro-batch or, with a process group, over the global batch), :func:`router_z_loss` (Zoph et
al. 2022), :func:`expert_capacity` and :func:`dispatch_positions` (first come, first served, the first
choices of all tokens before the second ones), :class:`MoELayer` (one process) and
:class:`ExpertParallelMoE` (experts split across the ranks of a group, tokens exchanged with two
all-to-alls each way), :class:`MoEBlock` / :func:`moe_gpt` (the tiny GPT with MoE FFNs), and
:func:`mixtral_parameters` (total vs active parameters from a published configuration).

As 2025's frontier models train MoE: :func:`route`'s ``bias`` and :func:`update_expert_bias`
(DeepSeek-V3's auxiliary-loss-free balancing), its ``n_nodes`` / ``max_nodes`` (node-limited routing) and
:func:`node_dispatch_rows` (the once-per-node dispatch's inter-node rows), :class:`DroplessMoE` (MegaBlocks:
no capacity, uneven all-to-all splits, the experts as one grouped matmul, :func:`grouped_linear`),
``MoELayer(n_shared=...)`` (DeepSeekMoE's shared experts) and :func:`deepseek_parameters`
(DeepSeek-V3's 671 B / 37 B)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib import collectives, trace
from course_lib._checks import _pos_int

__all__ = [
    "Routing", "router_dtype", "route", "tokens_per_expert", "load_balancing_loss", "router_z_loss",
    "expert_capacity", "dispatch_positions",
    "Expert", "MoELayer", "ExpertParallelMoE", "MoEBlock", "moe_gpt", "all_to_all_bytes",
    "mixtral_parameters", "MIXTRAL_8X7B", "update_expert_bias", "grouped_linear", "grouped_mm_available",
    "DroplessMoE", "dropless_bytes", "node_dispatch_rows", "deepseek_parameters", "DEEPSEEK_V3",
]


# --------------------------------------------------------------------------- routing
def router_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype the router computes in: float32, or float64 when an input is float64; never less.

    The router's output is a discrete choice. bf16 keeps 8 significant bits (7 stored): its ulp at 1.0
    is ``2**-7``, so logits that differ by less than that can round to the same bf16 value, and top-k
    then breaks the tie by position, not by score; the softmax weights lose the same bits. Production
    routers compute in fp32: Megatron-Core's ``--moe-router-dtype fp32`` (routing and the weighted sum
    of the expert outputs in fp32), DeepSeek-V3 keeps its MoE gating out of FP8, in its original
    precision (arXiv 2412.19437, §3.3.1)."""
    out = torch.float32
    for d in dtypes:
        out = torch.promote_types(out, d)
    return out


@dataclass
class Routing:
    """What the router decided for ``T`` tokens and ``E`` experts.

    ``logits``/``probs``: ``(T, E)`` (softmax over all experts); ``experts``: ``(T, k)`` the chosen
    expert ids, best first; ``weights``: ``(T, k)`` the combine weights (the chosen probabilities,
    renormalised to sum to 1 when ``normalize``). From :func:`route`, ``logits``, ``probs`` and
    ``weights`` are float32 (float64 for float64 inputs) whatever the dtype of the tokens."""
    logits: torch.Tensor
    probs: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor


def route(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, *, normalize: bool = True,
          noise_std: float = 0.0, generator: torch.Generator | None = None, bias: torch.Tensor | None = None,
          n_nodes: int | None = None, max_nodes: int | None = None) -> Routing:
    """Route tokens ``x`` ``(T, h)`` with the router's weight ``(E, h)`` (an ``nn.Linear`` layout).

    ``probs = softmax(x W^T)`` over all ``E`` experts; each token takes its ``top_k`` largest.
    ``normalize=True`` divides the chosen ``k`` probabilities by their sum (GShard, Mixtral: the
    weights of a token sum to 1, equal to a softmax over the chosen logits only); ``False`` keeps
    them as they are (Switch with ``k = 1``: the output is scaled by the router's confidence, which is
    what gives the router a gradient when ``k = 1``: a renormalised single weight is always 1).
    ``noise_std > 0`` adds Gaussian noise to the logits before the choice (exploration while training;
    Shazeer et al. 2017 learn its scale, here it is fixed).

    ``bias`` ``(E,)`` (auxiliary-loss-free load balancing, DeepSeek-V3, arXiv 2412.19437, §2.1.2): added
    to the probabilities **for the choice only**, ``top-k(probs + bias)``; the combine weights are the
    chosen experts' unbiased probabilities. No gradient reaches ``bias`` (a choice has none), and the
    gate's gradient is that of the unbiased probabilities. :func:`update_expert_bias` moves it.

    ``n_nodes``, ``max_nodes`` (node-limited routing, DeepSeek-V3 §2.1.2, with ``M = 4`` of its nodes):
    the experts sit on ``n_nodes`` nodes in contiguous blocks of ``E / n_nodes``; a token may use experts
    on at most ``max_nodes`` of them, the nodes with the largest sum of their ``max(1, k // max_nodes)``
    best (biased) scores; top-k then picks among those nodes' experts only. Expert parallelism places
    expert ``e`` on rank ``e // (E / n)``, so with ``n_nodes`` groups of ranks this caps the nodes each
    token's all-to-all reaches.

    Everything here runs in :func:`router_dtype` (float32 for bf16 or fp16 tokens and weights): the
    tokens and the router's weight are cast up before the product, so the logits of bf16 inputs are
    exact products summed in fp32, and the choice is the fp32 router's on the same values. The casts
    pass the gradient back in the inputs' dtypes. The combine weights stay in fp32; the layers cast
    where they multiply the expert outputs (see :class:`MoELayer`)."""
    if x.dim() != 2 or gate_weight.dim() != 2 or x.shape[1] != gate_weight.shape[1]:
        raise ValueError(f"route expects tokens (T, h) and a router weight (E, h); got {tuple(x.shape)} "
                         f"and {tuple(gate_weight.shape)}")
    E = gate_weight.shape[0]
    k = _pos_int("top_k", top_k)
    if k > E:
        raise ValueError(f"top_k={k} but there are only {E} experts; choose top_k <= {E}")
    dtype = router_dtype(x.dtype, gate_weight.dtype)
    logits = x.to(dtype) @ gate_weight.to(dtype).t()                     # (T, E) in fp32 (or fp64)
    if noise_std > 0:   # drawn where the generator lives (a CPU generator: the same noise on every device)
        where = generator.device if generator is not None else logits.device
        noise = torch.randn(logits.shape, generator=generator, dtype=logits.dtype, device=where)
        logits = logits + noise_std * noise.to(logits.device)
    probs = logits.softmax(dim=-1)
    scores = probs if bias is None else probs + _expert_vector("bias", bias, E).detach().to(probs)
    if n_nodes is not None or max_nodes is not None:
        scores = _limit_nodes(scores, k, n_nodes, max_nodes)
    top_i = scores.topk(k, dim=-1).indices                               # (T, k), best first
    top_p = probs.gather(1, top_i)                                       # the unbiased probabilities
    if normalize:
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    return Routing(logits, probs, top_i, top_p)


def _expert_vector(name: str, v: torch.Tensor, E: int) -> torch.Tensor:
    if not isinstance(v, torch.Tensor) or v.shape != (E,):
        raise ValueError(f"{name} must be a tensor of shape ({E},), one value per expert; got "
                         f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
    return v


def _limit_nodes(scores: torch.Tensor, k: int, n_nodes, max_nodes) -> torch.Tensor:
    """``scores`` with every expert outside each token's ``max_nodes`` best nodes set to ``-inf``."""
    T, E = scores.shape
    if n_nodes is None or max_nodes is None:
        raise ValueError("node-limited routing needs both n_nodes (how many nodes hold the experts) and "
                         "max_nodes (how many of them a token may use)")
    G, M = _pos_int("n_nodes", n_nodes), _pos_int("max_nodes", max_nodes)
    if E % G:
        raise ValueError(f"{E} experts do not split over n_nodes={G} nodes; choose n_nodes dividing {E}")
    if M > G or k > M * (E // G):
        raise ValueError(f"max_nodes={M} of n_nodes={G} with {E // G} experts each cannot hold top_k={k} "
                         f"experts; choose max_nodes with max_nodes * {E // G} >= {k} and max_nodes <= {G}")
    per_node = scores.view(T, G, E // G)                                 # (T, node, expert on it)
    node_score = per_node.topk(max(1, k // M), dim=-1).values.sum(-1)   # (T, G)
    keep = torch.zeros(T, G, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, node_score.topk(M, dim=-1).indices, True)           # each token's M best nodes
    return per_node.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)


def update_expert_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float, group=None) -> torch.Tensor:
    """Auxiliary-loss-free load balancing's update (DeepSeek-V3, arXiv 2412.19437, §2.1.2), in place:
    ``bias_i += rate * sign(mean load - load_i)``, after each training step.

    ``counts`` ``(E,)``: the step's choices per expert (:func:`tokens_per_expert`, or a layer's
    ``last["counts"]``). ``group``: ``None`` balances this process's micro-batch; a process group
    (data parallelism's) sums the counts over its ranks first (one all-reduce of ``E`` integers,
    collective over ``group``), so every rank applies the same update and the bias stays replicated.
    An overloaded expert's bias falls by ``rate``, an underloaded one's rises; the sign, not the size,
    of the imbalance sets the step (DeepSeek-V3 uses ``rate = 0.001`` for most of its training).
    Returns ``bias``."""
    E = bias.shape[0] if isinstance(bias, torch.Tensor) and bias.dim() == 1 else -1
    _expert_vector("bias", bias, E)
    _expert_vector("counts", counts, E)
    load = counts.detach().clone()
    if group is not None:
        dist.all_reduce(load, group=group)
    load = load.to(bias.dtype)
    with torch.no_grad():
        bias += rate * torch.sign(load.mean() - load)
    return bias


def tokens_per_expert(experts: torch.Tensor, n_experts: int, group=None) -> torch.Tensor:
    """How many of the ``(T, k)`` choices went to each expert: ``(E,)`` int64 counts.

    ``group`` (a process group, default ``None``): ``None`` counts this process's choices only; a group
    all-reduces (sums) the counts over its ranks, so every rank of it gets the counts of all their
    tokens. Collective then: every rank of ``group`` must call it (``dist.group.WORLD`` for all ranks;
    ``None`` here does *not* mean the world, as it does in ``torch.distributed``)."""
    counts = torch.bincount(experts.reshape(-1), minlength=n_experts)
    if group is not None:
        dist.all_reduce(counts, group=group)
    return counts


def load_balancing_loss(routing: Routing, alpha: float = 0.01, group=None) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, §2.2, Eq. 4-6):
    ``alpha * E * sum_i f_i * P_i``.

    ``f_i``: the fraction of the token choices dispatched to expert ``i``, counted over all ``k``
    choices of every token (Megatron-Core's and Hugging Face's convention; GShard's Algorithm 1 counts
    first choices only; for ``k = 1`` the two agree); not differentiable. ``P_i``: the mean router
    probability of expert ``i`` over the tokens; its gradient pushes probability away from the experts
    that receive too much. Balanced routing (``f_i = P_i = 1/E``) gives ``alpha``, which is not a lower
    bound: ``f`` and ``P`` can disagree (``E = 2``, ``f = (0.6, 0.4)``, ``P = (0.304, 0.696)`` give
    ``0.92 alpha``). All tokens on one expert with full confidence give ``alpha * E``.

    ``group=None`` (the default): ``f`` over this process's micro-batch, as Switch defines it. A
    process group (data parallelism's, usually): the global-batch statistic of Qiu et al. 2025
    ("Demons in the Detail", arXiv 2501.11873; Megatron-Core's ``--moe-router-load-balancing-type
    global_aux_loss``). What is reduced: only the ``E`` token counts, summed over the ranks of
    ``group`` (:func:`tokens_per_expert`), so ``f`` is the fraction of all their tokens' choices; one
    all-reduce of ``E`` integers, collective over ``group``. What is not: ``P`` stays this rank's
    mean over its own tokens, so the gradient stays local and no gradient crosses ranks (the counts
    carry none: they are integers from a top-k). Averaged over the data-parallel ranks, as data
    parallelism averages gradients, the gradient is that of ``alpha E sum_i f_i P_i`` with both ``f``
    and ``P`` over the global batch (exactly so when every rank has as many tokens). The balance is
    then asked of the global batch, not of every micro-batch: a micro-batch of few sequences may favour
    some experts (code to the code experts), which Qiu et al. find helps the experts specialise.

    Computed in :func:`router_dtype` (fp32 at least) whatever the dtype of ``routing.probs``."""
    T, E = routing.probs.shape
    counts = tokens_per_expert(routing.experts, E, group)
    probs = routing.probs.to(router_dtype(routing.probs.dtype))
    f = counts.to(probs.dtype) / counts.sum()            # local: counts.sum() = k T
    P = probs.mean(dim=0)
    return alpha * E * (f * P).sum()


def router_z_loss(routing: Routing, beta: float = 1e-3) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, §3.1, Eq. 5): ``beta * mean_t (log sum_i exp(x_ti))^2``;
    keeps the router's logits small, which keeps its softmax numerically stable. In
    :func:`router_dtype` (fp32 at least)."""
    logits = routing.logits.to(router_dtype(routing.logits.dtype))
    return beta * torch.logsumexp(logits, dim=-1).pow(2).mean()


def expert_capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Slots per expert: ``ceil(capacity_factor * k * T / E)`` (Fedus et al. 2021, Eq. 3, with ``k``
    choices per token). ``capacity_factor = 1`` is exactly enough when routing is perfectly balanced;
    ``None`` means no limit: ``T`` slots (a token chooses an expert at most once, so nothing drops)."""
    T, E, k = _pos_int("n_tokens", n_tokens, 0), _pos_int("n_experts", n_experts), _pos_int("top_k", top_k)
    if capacity_factor is None:
        return max(T, 1)
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor!r}")
    return max(1, math.ceil(capacity_factor * k * T / E))


def dispatch_positions(experts: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """The slot each choice gets in its expert's buffer, or ``-1`` when the expert is full (dropped).

    ``experts``: ``(T, k)``. Slots are handed out first come, first served, all tokens' first choices
    before any second choice (GShard's order: a token's best expert matters most), tokens in order.
    Returns ``(T, k)`` int64."""
    T, k = experts.shape
    order = experts.t().reshape(-1)                                      # choice j of all tokens, then j+1
    onehot = F.one_hot(order, n_experts)                                 # (k T, E)
    pos = (onehot.cumsum(dim=0) - 1).gather(1, order[:, None]).squeeze(1)   # rank among its expert's choices
    pos = torch.where(pos < capacity, pos, torch.full_like(pos, -1))
    return pos.view(k, T).t().contiguous()


class _FP32Bias:
    """Keeps a layer's ``expert_bias`` in fp32 (or fp64) through ``.to(bfloat16)`` / ``.half()``: its
    updates are ``rate = 0.001`` steps, below bf16's resolution at the size the bias reaches (its ulp is
    ``2**-7`` at 1.0), so in bf16 they would round away. Device moves still apply."""

    def _apply(self, fn, recurse=True):
        before = self.expert_bias
        out = super()._apply(fn, recurse)
        if self.expert_bias.dtype in (torch.bfloat16, torch.float16):
            self.expert_bias = before.to(device=self.expert_bias.device, dtype=torch.float32)
        return out


# --------------------------------------------------------------------------- experts and the layer
class Expert(nn.Module):
    """A two-layer FFN ``fc2(act(fc1(x)))``: the tiny GPT's MLP (GELU, ``d_ff = 4 h``) or notebook 10's
    exercise 3 expert (ReLU)."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu"):
        super().__init__()
        if activation not in ("gelu", "relu"):
            raise ValueError(f"activation must be 'gelu' or 'relu', got {activation!r}")
        self.fc1, self.fc2, self.activation = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model), activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(F.gelu(h) if self.activation == "gelu" else F.relu(h))


class MoELayer(_FP32Bias, nn.Module):
    """A mixture-of-experts FFN on one process: ``(..., h) -> (..., h)``.

    Args:
        d_model, d_ff: sizes of each expert (``Expert``), ``n_experts``: ``E``, ``top_k``: ``k``.
        capacity_factor: slots per expert ``ceil(cf * k * T / E)`` for the ``T`` tokens of a call;
            ``None``: unlimited (no token is dropped).
        normalize: renormalise each token's ``k`` weights (see :func:`route`).
        noise_std: router noise while ``self.training``.
        activation: the experts' (``"gelu"`` or ``"relu"``).
        n_shared: always-on *shared* experts of the same size (DeepSeekMoE, Dai et al. 2024, arXiv
            2401.06066, §3.2): every token goes through them, unweighted, next to its ``k`` routed ones.
        balance_group: the process group over which ``lb_loss`` counts ``f`` (the global-batch
            statistic, :func:`load_balancing_loss`); ``None``: this process's tokens only. With a group
            every forward is collective over it.

    Precision: the router runs in fp32 (:func:`route`) whatever the layer's dtype; the experts run in
    the layer's dtype. The combine multiplies each expert output, cast to fp32, by its fp32 weight and
    sums a token's ``k`` terms in fp32; the sum is cast back to the tokens' dtype once (Megatron-Core's
    ``--moe-router-dtype fp32`` does the weighted sum in fp32 too). The weights' gradient is fp32.

    ``self.expert_bias`` ``(E,)`` (a buffer, zero at first): the per-expert bias of auxiliary-loss-free
    balancing, added for the choice only (:func:`route`); :meth:`update_bias` moves it after a step.

    After each call ``self.last`` holds ``routing`` (:class:`Routing`), ``counts`` (this process's
    choices per expert, before dropping), ``dropped`` (fraction of the ``k T`` choices that found no
    slot) and the two auxiliary losses ``lb_loss`` (:func:`load_balancing_loss` with ``alpha = 1``:
    scale it yourself) and ``z_loss`` (with ``beta = 1``).
    """

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int = 2, *,
                 capacity_factor: float | None = None, normalize: bool = True, noise_std: float = 0.0,
                 activation: str = "gelu", balance_group=None, n_shared: int = 0):
        super().__init__()
        self.n_experts, self.top_k = _pos_int("n_experts", n_experts), _pos_int("top_k", top_k)
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={top_k} but only {n_experts} experts; choose top_k <= n_experts")
        self.capacity_factor, self.normalize, self.noise_std = capacity_factor, normalize, noise_std
        self.balance_group = balance_group
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, d_ff, activation) for _ in range(n_experts))
        self.shared = nn.ModuleList(Expert(d_model, d_ff, activation) for _ in range(_pos_int("n_shared", n_shared, 0)))
        # auxiliary-loss-free balancing's bias (route's ``bias``): state, not a parameter; zero changes nothing
        self.register_buffer("expert_bias", self.gate.weight.new_zeros(n_experts, dtype=torch.float32))
        self.last: dict = {}

    def capacity(self, n_tokens: int) -> int:
        """Slots per expert for ``n_tokens`` tokens (:func:`expert_capacity`; all of them when
        ``capacity_factor`` is ``None``: an expert can take every token and nothing drops)."""
        return expert_capacity(n_tokens, self.n_experts, self.top_k, self.capacity_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])                                    # (T, h)
        with trace.span("compute", "route"):
            r = route(tokens, self.gate.weight, self.top_k, normalize=self.normalize,
                      noise_std=self.noise_std if self.training else 0.0, bias=self.expert_bias)
            pos = dispatch_positions(r.experts, self.n_experts, self.capacity(tokens.shape[0]))
        out = tokens.new_zeros(tokens.shape, dtype=r.weights.dtype)          # the combine's sum, in fp32
        with trace.span("compute", "experts"):
            for expert in self.shared:                                       # every token, weight 1
                out = out + expert(tokens).to(out.dtype)
            for e, expert in enumerate(self.experts):
                t_idx, slot = ((r.experts == e) & (pos >= 0)).nonzero(as_tuple=True)   # kept choices of e
                if t_idx.numel():
                    y = expert(tokens[t_idx])                                # (T_e, h) in the layer's dtype
                    out = out.index_add(0, t_idx, y.to(out.dtype) * r.weights[t_idx, slot, None])
        self.last = {"routing": r, "counts": tokens_per_expert(r.experts, self.n_experts),
                     "dropped": float((pos < 0).float().mean()),
                     "lb_loss": load_balancing_loss(r, 1.0, self.balance_group),
                     "z_loss": router_z_loss(r, 1.0)}
        return out.to(tokens.dtype).view(shape)

    def aux_loss(self, alpha: float = 0.01, beta: float = 0.0) -> torch.Tensor:
        """``alpha * lb_loss + beta * z_loss`` of the last call (add it to the training loss)."""
        return alpha * self.last["lb_loss"] + beta * self.last["z_loss"]

    def update_bias(self, rate: float, group=None) -> torch.Tensor:
        """Auxiliary-loss-free balancing after a step: :func:`update_expert_bias` of ``self.expert_bias``
        with the last call's counts (``group``: summed over its ranks first). Returns the bias."""
        return update_expert_bias(self.expert_bias, self.last["counts"], rate, group)


# --------------------------------------------------------------------------- expert parallelism
class _AllToAll(torch.autograd.Function):
    """All-to-all of equal blocks along dim 0 (``world`` blocks); its gradient is the all-to-all of the
    gradient blocks back (the transpose of a permutation is its inverse)."""

    @staticmethod
    def forward(ctx, x, group, builtin, name):
        ctx.group, ctx.builtin, ctx.name = group, builtin, name
        return _all_to_all(x, group, builtin, name)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.group, ctx.builtin, ctx.name + " (backward)"), None, None, None


def _all_to_all(x: torch.Tensor, group, builtin: bool, name: str) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    with trace.span("comm", name):
        collectives.all_to_all_single(out, x, group=group, builtin=builtin)
    return out


def all_to_all_bytes(world_size: int, experts_per_rank: int, capacity: int, d_model: int,
                     bytes_per_value: int = 4) -> int:
    """Bytes one rank sends in one all-to-all of :class:`ExpertParallelMoE`: a block of
    ``experts_per_rank * capacity * d_model`` values to each of the other ``world_size - 1`` ranks (the
    buffers have a fixed size, padded where an expert got fewer tokens). A forward sends two (dispatch
    and combine), the backward two more."""
    return (world_size - 1) * experts_per_rank * capacity * d_model * bytes_per_value


class ExpertParallelMoE(_FP32Bias, nn.Module):
    """An MoE layer with its ``E`` experts split across the ``n`` ranks of ``group`` (``E / n`` each).

    Every rank routes its own tokens (the router is replicated; data parallelism over tokens), packs
    them into a fixed-size buffer ``(n, E/n, C, h)`` (``C`` slots per expert and source rank, GShard's
    layout), and one all-to-all sends block ``j`` to rank ``j``; each rank runs its experts on what it
    received from every rank; a second all-to-all returns the results, and each rank combines its
    tokens' outputs. The backward runs the same two all-to-alls in reverse.

    ``capacity_factor=None`` gives every expert room for all of a rank's tokens (nothing drops: equal to
    :class:`MoELayer` on the concatenated tokens of all ranks). The replicated router's gradient is
    partial on each rank and the experts' are summed over every rank's tokens: :meth:`sync_grads` puts both
on data parallelism's convention (the gradient of the mean over all ranks' tokens).

    Precision as in :class:`MoELayer`: the router and the combine in fp32, the experts and the
    all-to-all buffers in the tokens' dtype. ``balance_group`` as there (``self.group``, the ranks whose
    tokens these experts serve, is the natural choice for the global-batch statistic; ``None``: this
    rank's tokens only).
    """

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int = 2, group=None, *,
                 capacity_factor: float | None = None, normalize: bool = True, activation: str = "gelu",
                 builtin: bool = False, balance_group=None, _full: MoELayer | None = None):
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        if n_experts % n:
            raise ValueError(f"{n_experts} experts do not split over {n} ranks; use a multiple of {n} experts "
                             f"or a group whose size divides {n_experts}")
        self.group, self.world, self.rank, self.builtin = group, n, r, builtin
        self.n_experts, self.top_k, self.local = n_experts, top_k, n_experts // n
        self.capacity_factor, self.normalize, self.balance_group = capacity_factor, normalize, balance_group
        self.first = r * self.local                       # my experts: first .. first + local - 1
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, d_ff, activation) for _ in range(self.local))
        self.register_buffer("expert_bias", self.gate.weight.new_zeros(n_experts, dtype=torch.float32))
        self.n_nodes = self.max_nodes = None         # node-limited routing: set both (see route)
        if _full is not None:
            if len(getattr(_full, "shared", ())):
                raise ValueError("shared experts are not split by expert parallelism here; use n_shared=0")
            self.gate = copy.deepcopy(_full.gate)
            self.experts = nn.ModuleList(copy.deepcopy(_full.experts[self.first + i]) for i in range(self.local))
            self.expert_bias = _full.expert_bias.detach().clone()
        self.last: dict = {}

    @classmethod
    def from_moe(cls, moe: MoELayer, group=None, *, builtin: bool = False) -> "ExpertParallelMoE":
        """Split ``moe`` (the same on every rank): this rank keeps its ``E / n`` experts and the router
        (and ``moe.balance_group``)."""
        e0 = moe.experts[0]
        return cls(e0.fc1.in_features, e0.fc1.out_features, moe.n_experts, moe.top_k, group,
                   capacity_factor=moe.capacity_factor, normalize=moe.normalize, activation=e0.activation,
                   builtin=builtin, balance_group=moe.balance_group, _full=moe)

    def capacity(self, n_tokens: int) -> int:
        """Slots per expert for ``n_tokens`` tokens (:func:`expert_capacity`; all of them when
        ``capacity_factor`` is ``None``: an expert can take every token and nothing drops)."""
        return expert_capacity(n_tokens, self.n_experts, self.top_k, self.capacity_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])                                    # (T, h) this rank's tokens
        T, h = tokens.shape
        n, L, C = self.world, self.local, self.capacity(T)
        with trace.span("compute", "route"):
            r = self._route(tokens)
            pos = dispatch_positions(r.experts, self.n_experts, C)           # (T, k) slot or -1
        with trace.span("compute", "dispatch: pack"):
            keep = pos >= 0
            t_idx, j_idx = keep.nonzero(as_tuple=True)                       # kept choices
            e_idx, s_idx = r.experts[t_idx, j_idx], pos[t_idx, j_idx]
            flat = torch.zeros(self.n_experts * C, h, dtype=tokens.dtype, device=tokens.device)
            flat = flat.index_copy(0, e_idx * C + s_idx, tokens[t_idx])      # (E C, h): expert-major
        # expert e lives on rank e // L: block j of the buffer (experts j L .. (j+1) L - 1) goes to rank j
        recv = _AllToAll.apply(flat, self.group, self.builtin, "all-to-all: dispatch")   # (n L C, h)
        with trace.span("compute", "experts"):
            recv = recv.view(n, L, C, h)                                     # (source rank, my expert, slot, h)
            outs = [self.experts[i](recv[:, i].reshape(n * C, h)).view(n, 1, C, h) for i in range(L)]
            done = torch.cat(outs, dim=1).reshape(n * L * C, h)
        back = _AllToAll.apply(done, self.group, self.builtin, "all-to-all: combine")    # (E C, h) mine
        with trace.span("compute", "combine"):
            w = r.weights[t_idx, j_idx, None]                                # fp32 (or fp64)
            y = back.index_select(0, e_idx * C + s_idx).to(w.dtype) * w
            out = tokens.new_zeros(tokens.shape, dtype=w.dtype).index_add(0, t_idx, y).to(tokens.dtype)
        self.last = {"routing": r, "counts": tokens_per_expert(r.experts, self.n_experts),
                     "dropped": float((~keep).float().mean()), "capacity": C,
                     "lb_loss": load_balancing_loss(r, 1.0, self.balance_group),
                     "z_loss": router_z_loss(r, 1.0)}
        return out.view(shape)

    def _route(self, tokens: torch.Tensor) -> Routing:
        return route(tokens, self.gate.weight, self.top_k, normalize=self.normalize, bias=self.expert_bias,
                     n_nodes=self.n_nodes, max_nodes=self.max_nodes)

    def update_bias(self, rate: float, group=None) -> torch.Tensor:
        """As :meth:`MoELayer.update_bias`; pass the group whose ranks share this router (``self.group``
        for the global-batch load) so that the bias stays the same on all of them."""
        return update_expert_bias(self.expert_bias, self.last["counts"], rate, group)

    def sync_grads(self) -> None:
        """Put the gradients on data parallelism's convention, after the backward and before the step.

        Each rank's loss is the mean over its own tokens and data parallelism averages the gradients
        over the ``n`` ranks: the gradient of the mean over all tokens. The replicated router saw only
        this rank's tokens, so its gradient is all-reduced and divided by ``n``. An expert's gradient
        already holds the contributions of every rank's tokens (the all-to-all's backward brought them
        here): a sum over the ``n`` ranks' losses, ``n`` times the gradient of the mean. It is divided
        by ``n`` without communication, as Megatron-Core scales expert gradients by ``1 / dp``. Without
        this, experts would get ``n`` times the gradient that the router and the dense layers get:
        Adam's update hides that, SGD and gradient clipping do not."""
        g = self.gate.weight.grad
        if g is not None:
            dist.all_reduce(g, group=self.group)
            g /= self.world
        for p in self.experts.parameters():
            if p.grad is not None:
                p.grad /= self.world


# --------------------------------------------------------------------------- dropless (MegaBlocks)
_GROUPED_MM_OK: dict = {}


def _grouped_mm_fn():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_available(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch's grouped matmul (``F.grouped_mm``, or ``torch._grouped_mm`` before it had a
    public name) runs forward and backward on ``device`` for ``dtype``: tried once on a tiny problem,
    the answer cached. On torch 2.13's CPU build it does for float32 / bfloat16 / float16 (not float64),
    with rows whose size in bytes is a multiple of 16; older builds may lack it (then ``False``)."""
    key = (torch.device(device).type, dtype)
    if key not in _GROUPED_MM_OK:
        fn, ok = _grouped_mm_fn(), False
        if fn is not None and dtype in (torch.float32, torch.bfloat16, torch.float16):
            try:
                a = torch.ones(6, 8, dtype=dtype, device=device, requires_grad=True)
                b = torch.ones(2, 8, 8, dtype=dtype, device=device, requires_grad=True)
                offs = torch.tensor([2, 6], dtype=torch.int32, device=device)
                y = fn(a, b.transpose(1, 2), offs=offs)
                y.backward(torch.ones_like(y))
                ok = bool(torch.allclose(y.float(), torch.full_like(y, 8.0).float())) and b.grad is not None
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _GROUPED_MM_OK[key] = ok
    return _GROUPED_MM_OK[key]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (the grouped matmul's backward needs one)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counts: torch.Tensor,
                   *, use_grouped_mm: bool | None = None) -> torch.Tensor:
    """``G`` linear layers on consecutive row blocks: rows ``[o_g, o_g + counts[g])`` of ``x`` ``(N, in)``
    go through ``weight[g]`` ``(out, in)`` (``nn.Linear``'s layout) and ``bias[g]``; ``(N, out)``.

    One grouped matmul (MegaBlocks' block-sparse product, Gale et al. 2022, arXiv 2211.15841, §5; here
    torch's ``F.grouped_mm``) where :func:`grouped_mm_available` says this torch has one that works for
    the device and dtype and the sizes are 16-byte aligned; otherwise a loop of ``G`` matmuls, one per
    expert (the same values). ``use_grouped_mm``: force one or the other (``None``: decide)."""
    G = weight.shape[0]
    if counts.shape != (G,):
        raise ValueError(f"counts must have one entry per group ({G}), got shape {tuple(counts.shape)}")
    es = x.element_size()
    aligned = (x.shape[1] * es) % 16 == 0 and (weight.shape[1] * es) % 16 == 0
    if use_grouped_mm is None:
        use_grouped_mm = aligned and x.shape[0] > 0 and grouped_mm_available(x.device, x.dtype)
    if use_grouped_mm:
        offs = counts.cumsum(0).to(torch.int32)
        y = _ContiguousGrad.apply(_grouped_mm_fn()(x, weight.transpose(1, 2), offs=offs))
    else:
        sizes = [int(c) for c in counts]
        y = torch.cat([xs @ w.t() for xs, w in zip(x.split(sizes), weight)] + [x.new_zeros(0, weight.shape[1])])
    if bias is not None:
        y = y + bias.repeat_interleave(counts, dim=0, output_size=x.shape[0])
    return y


def _experts_grouped(experts: nn.ModuleList, x: torch.Tensor, counts: torch.Tensor,
                     use_grouped_mm: bool | None) -> torch.Tensor:
    """The experts on consecutive row blocks of ``x`` (``counts[i]`` rows for expert ``i``), two grouped
    linears and the activation between them; the weights are stacked each call, so the gradients land in
    each expert's own parameters."""
    w1 = torch.stack([e.fc1.weight for e in experts]); b1 = torch.stack([e.fc1.bias for e in experts])
    w2 = torch.stack([e.fc2.weight for e in experts]); b2 = torch.stack([e.fc2.bias for e in experts])
    h = grouped_linear(x, w1, b1, counts, use_grouped_mm=use_grouped_mm)
    h = F.gelu(h) if experts[0].activation == "gelu" else F.relu(h)
    return grouped_linear(h, w2, b2, counts, use_grouped_mm=use_grouped_mm)


class _AllToAllV(torch.autograd.Function):
    """All-to-all with uneven blocks along dim 0: ``send_sizes[j]`` rows go to rank j, ``recv_sizes[i]``
    rows arrive from rank i. Its gradient is the same exchange with the sizes swapped."""

    @staticmethod
    def forward(ctx, x, send_sizes, recv_sizes, group, builtin, name):
        ctx.args = (send_sizes, recv_sizes, group, builtin, name)
        return _all_to_all_v(x, send_sizes, recv_sizes, group, builtin, name)

    @staticmethod
    def backward(ctx, grad):
        send_sizes, recv_sizes, group, builtin, name = ctx.args
        return (_all_to_all_v(grad.contiguous(), recv_sizes, send_sizes, group, builtin, name + " (backward)"),
                None, None, None, None, None)


def _all_to_all_v(x, send_sizes, recv_sizes, group, builtin, name):
    x = x.contiguous()
    out = x.new_empty((sum(recv_sizes),) + tuple(x.shape[1:]))
    with trace.span("comm", name):
        if builtin:   # gloo and NCCL take uneven splits (in rows of dim 0)
            dist.all_to_all_single(out, x, output_split_sizes=list(recv_sizes),
                                   input_split_sizes=list(send_sizes), group=group)
        else:         # the course's pairwise exchange: blocks may differ in size
            collectives.all_to_all(list(out.split(list(recv_sizes))), list(x.split(list(send_sizes))), group=group)
    return out


class DroplessMoE(ExpertParallelMoE):
    """Expert parallelism without capacity (MegaBlocks, Gale et al. 2022, arXiv 2211.15841): no token is
    dropped and nothing is padded; each rank sends exactly its ``k T`` choices.

    Per forward, on every rank of ``group``:

    1. route, and sort this rank's ``k T`` choices by expert (experts ``j L .. (j+1) L - 1`` live on
       rank ``j``, so the sorted rows are already grouped by destination);
    2. exchange the counts: an all-to-all of ``E`` integers tells rank ``j`` how many rows of each of its
       ``L`` experts every rank will send (``n L`` integers received), hence the split sizes;
    3. the tokens: an all-to-all with uneven splits (``dist.all_to_all_single`` with
       ``input_split_sizes`` / ``output_split_sizes``, or the course's pairwise one);
    4. reorder what arrived (source rank, expert) into (expert, source rank) and run the ``L`` experts
       as one grouped matmul (:func:`grouped_linear`; a loop where this torch has none for the dtype);
    5. the results back with the splits swapped, and combine, in fp32 as :class:`MoELayer` does.

    Equal, forward and backward, to :class:`MoELayer` with ``capacity_factor=None`` on all ranks'
    tokens; :meth:`sync_grads` as in :class:`ExpertParallelMoE`. ``self.last`` adds ``sent_rows`` / ``recv_rows``
    (rows this rank sent to / received from each rank in the dispatch; the combine sends them back the
    other way) and ``received`` (rows per local expert).
    ``use_grouped_mm``: ``None`` decides (:func:`grouped_mm_available`), ``True``/``False`` forces."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int = 2, group=None, *,
                 capacity_factor: float | None = None, use_grouped_mm: bool | None = None, **kwargs):
        if capacity_factor is not None:
            raise ValueError(f"DroplessMoE has no capacity; got capacity_factor={capacity_factor!r} (use None, or "
                             "ExpertParallelMoE for fixed-size buffers)")
        super().__init__(d_model, d_ff, n_experts, top_k, group, capacity_factor=None, **kwargs)
        self.use_grouped_mm = use_grouped_mm

    @classmethod
    def from_moe(cls, moe: MoELayer, group=None, *, builtin: bool = False,
                 use_grouped_mm: bool | None = None) -> "DroplessMoE":
        """Split ``moe`` (the same on every rank; its capacity is ignored: nothing drops here)."""
        e0 = moe.experts[0]
        return cls(e0.fc1.in_features, e0.fc1.out_features, moe.n_experts, moe.top_k, group,
                   normalize=moe.normalize, activation=e0.activation, builtin=builtin,
                   balance_group=moe.balance_group, use_grouped_mm=use_grouped_mm, _full=moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])                                    # (T, h) this rank's tokens
        T, h = tokens.shape
        n, L, k = self.world, self.local, self.top_k
        with trace.span("compute", "route"):
            r = self._route(tokens)
            flat_e = r.experts.reshape(-1)                                   # (T k,) choice c = t k + j
            order = torch.argsort(flat_e, stable=True)                       # choices sorted by expert
            counts = torch.bincount(flat_e, minlength=self.n_experts)        # (E,)
        with trace.span("comm", "all-to-all: counts"):
            got = torch.empty_like(counts)                                   # (n L,): [source][my expert]
            collectives.all_to_all_single(got, counts, group=self.group, builtin=self.builtin)
        send_sizes = counts.view(n, L).sum(1).tolist()                       # rows to each rank
        recv = got.view(n, L)
        recv_sizes = recv.sum(1).tolist()                                    # rows from each rank
        with trace.span("compute", "dispatch: pack"):
            packed = tokens.index_select(0, order // k)                      # (T k, h), grouped by rank
        arrived = _AllToAllV.apply(packed, send_sizes, recv_sizes, self.group, self.builtin,
                                   "all-to-all: dispatch")                   # (sum recv, h): (source, expert)
        with trace.span("compute", "experts"):
            # rows arrive as (source s, expert i) blocks; the grouped matmul wants (expert i, source s)
            block = torch.arange(n * L, device=tokens.device).repeat_interleave(recv.reshape(-1))
            by_expert = torch.argsort(block % L, stable=True)                # rows of expert 0, then 1, ...
            y = _experts_grouped(self.experts, arrived.index_select(0, by_expert), recv.sum(0),
                                 self.use_grouped_mm)
            done = torch.empty_like(y).index_copy(0, by_expert, y)            # back to (source, expert)
        back = _AllToAllV.apply(done, recv_sizes, send_sizes, self.group, self.builtin,
                                "all-to-all: combine")                       # (T k, h) in `order`
        with trace.span("compute", "combine"):
            w = r.weights.reshape(-1).index_select(0, order)[:, None]        # fp32 (or fp64)
            out = tokens.new_zeros(tokens.shape, dtype=w.dtype).index_add(0, order // k, back.to(w.dtype) * w)
        self.last = {"routing": r, "counts": counts, "dropped": 0.0, "sent_rows": send_sizes, "recv_rows": recv_sizes,
                     "received": recv.sum(0).tolist(),
                     "lb_loss": load_balancing_loss(r, 1.0, self.balance_group), "z_loss": router_z_loss(r, 1.0)}
        return out.to(tokens.dtype).view(shape)

    def capacity(self, n_tokens: int) -> int:
        raise AttributeError("DroplessMoE has no capacity: every choice is sent (see last['sent_rows'])")


def dropless_bytes(sent_rows: list[int], rank: int, d_model: int, bytes_per_value: int = 4) -> int:
    """Bytes one rank sends to the other ranks in one token all-to-all of :class:`DroplessMoE`: its rows
    for every other rank (``sent_rows``, ``last["sent_rows"]``) times ``d_model`` values. The counts'
    all-to-all adds ``(n - 1) E / n`` integers."""
    return sum(c for j, c in enumerate(sent_rows) if j != rank) * d_model * bytes_per_value


def node_dispatch_rows(experts: torch.Tensor, experts_per_rank: int, ranks_per_node: int, rank: int,
                       world_size: int) -> list[int]:
    """Rows ``rank`` sends to each rank in the first, inter-node hop of DeepSeek-V3's dispatch (arXiv
    2412.19437, §3.2.2): each token goes **once** to every other node that holds one of its experts, to
    that node's rank with the same local index (over InfiniBand), which forwards it to the node's other
    ranks (over NVLink, not counted here). ``experts`` ``(T, k)``: the routing's choices; ranks
    ``[m R, (m+1) R)`` form node ``m`` (``R = ranks_per_node``) and expert ``e`` lives on rank
    ``e // experts_per_rank``. With node-limited routing (:func:`route`'s ``max_nodes = M``) no token
    crosses to more than ``M`` nodes (``M - 1`` others when its own node is among them)."""
    R = _pos_int("ranks_per_node", ranks_per_node)
    if world_size % R:
        raise ValueError(f"world_size={world_size} ranks do not form nodes of {R}; choose ranks_per_node dividing it")
    n_nodes, (my_node, local) = world_size // R, divmod(rank, R)
    node = experts // (experts_per_rank * R)                                 # (T, k) node of each choice
    hit = torch.zeros(experts.shape[0], n_nodes, dtype=torch.bool, device=experts.device)
    hit.scatter_(1, node, True)                                              # (T, nodes): does t go there
    rows = [0] * world_size
    for m in range(n_nodes):
        if m != my_node:
            rows[m * R + local] = int(hit[:, m].sum())
    return rows


# --------------------------------------------------------------------------- in a GPT
class MoEBlock(nn.Module):
    """``models.Block`` with its FFN replaced by an MoE layer: ``x + attn(ln1(x))``, then ``x + moe(ln2(x))``
    (a token dropped by every chosen expert passes through the residual unchanged)."""

    def __init__(self, block: nn.Module, moe: nn.Module):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.moe = block.ln1, block.attn, block.ln2, moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


def moe_gpt(n_experts: int, top_k: int = 2, *, capacity_factor: float | None = 1.25, normalize: bool = True,
            noise_std: float = 0.0, balance_group=None, expert_ff: int | None = None, n_shared: int = 0,
            **gpt_kwargs) -> nn.Module:
    """A :class:`course_lib.models.TinyGPT` (``gpt_kwargs``) whose blocks' FFNs are :class:`MoELayer`
    of ``n_experts`` experts of the dense FFN's size (``4 h``; ``expert_ff`` for smaller, fine-grained
    ones) and ``n_shared`` shared experts. ``model.moe_layers()`` lists them.
    ``balance_group``: each layer's (see :class:`MoELayer`)."""
    from course_lib.models import TinyGPT
    model = TinyGPT(**gpt_kwargs)
    h = model.wte.embedding_dim
    model.blocks = nn.ModuleList(
        MoEBlock(b, MoELayer(h, expert_ff or 4 * h, n_experts, top_k, capacity_factor=capacity_factor,
                             normalize=normalize, noise_std=noise_std, balance_group=balance_group,
                             n_shared=n_shared)) for b in model.blocks)
    model.moe_layers = lambda: [b.moe for b in model.blocks]
    return model


# --------------------------------------------------------------------------- Mixtral's arithmetic
#: Mixtral 8x7B's published configuration (Jiang et al. 2024, Table 1; the model's config.json):
#: SwiGLU experts (three matrices each), grouped-query attention, untied input and output embeddings.
MIXTRAL_8X7B = dict(hidden=4096, layers=32, ffn=14336, experts=8, top_k=2, heads=32, kv_heads=8, vocab=32000)


def mixtral_parameters(hidden: int, layers: int, ffn: int, experts: int, top_k: int, heads: int,
                       kv_heads: int, vocab: int) -> dict:
    """Total and active (per token) parameters of a Mixtral-style decoder, counted matrix by matrix.

    Per layer: attention ``q, o: h x h`` and ``k, v: h x (h kv_heads / heads)``; ``experts`` SwiGLU FFNs
    of three ``h x ffn`` matrices; a router ``h x experts``; two RMSNorm vectors. Around the layers:
    token embedding and output head, ``vocab x h`` each (untied), and a final norm. No biases.
    Active parameters count ``top_k`` experts instead of all of them (the embedding lookup counted as
    active, as Mistral's "12.9B active" does). Returns a dict of counts."""
    h, kv = hidden, hidden * kv_heads // heads
    attention = 2 * h * h + 2 * h * kv
    expert = 3 * h * ffn
    router, norms = h * experts, 2 * h
    embeddings = 2 * vocab * h + h
    total = layers * (attention + experts * expert + router + norms) + embeddings
    active = layers * (attention + top_k * expert + router + norms) + embeddings
    return {"attention_per_layer": attention, "expert": expert, "router_per_layer": router,
            "embeddings": embeddings, "total": total, "active": active}


# --------------------------------------------------------------------------- DeepSeek-V3's arithmetic
#: DeepSeek-V3's published configuration (arXiv 2412.19437, §4.2 "Hyper-Parameters"; the released
#: config.json for the two numbers the paper rounds: the dense layers' FFN width and the vocabulary).
#: MLA attention (q and kv compressed to ranks 1536 and 512, 128 heads of 128 + 64 decoupled RoPE
#: channels), the first 3 of 61 layers dense, the rest DeepSeekMoE: 1 shared + 256 routed SwiGLU experts
#: of width 2048, 8 routed per token, on at most 4 of 8 nodes; untied embeddings.
DEEPSEEK_V3 = dict(hidden=7168, layers=61, dense_layers=3, dense_ffn=18432, expert_ffn=2048, routed=256,
                   shared=1, top_k=8, heads=128, q_rank=1536, kv_rank=512, head_dim=128, rope_dim=64,
                   v_head_dim=128, vocab=129280)


def deepseek_parameters(hidden: int, layers: int, dense_layers: int, dense_ffn: int, expert_ffn: int,
                        routed: int, shared: int, top_k: int, heads: int, q_rank: int, kv_rank: int,
                        head_dim: int, rope_dim: int, v_head_dim: int, vocab: int) -> dict:
    """Total and active (per token) parameters of a DeepSeek-V3-style decoder, counted matrix by matrix as
    :func:`mixtral_parameters` counts Mixtral's (the multi-token-prediction module left out, as the
    report's 671 B does).

    Attention (MLA, DeepSeek-V2 arXiv 2405.04434 §2.1): ``W_DQ h x q_rank``, a norm, ``W_UQ q_rank x
    heads (head_dim + rope_dim)``; ``W_DKV`` and the shared RoPE key ``h x (kv_rank + rope_dim)``, a norm,
    ``W_UK, W_UV: kv_rank x heads (head_dim + v_head_dim)``; ``W_O: heads v_head_dim x h``. FFNs: SwiGLU
    (three matrices); the first ``dense_layers`` dense of width ``dense_ffn``, the others ``shared``
    always-on plus ``routed`` experts of width ``expert_ffn``, ``top_k`` of them active, and a router
    ``h x routed`` (its per-expert balancing bias too). Two RMSNorm vectors per layer; untied embedding
    and head ``vocab x h``, a final norm. Returns a dict of counts."""
    h = hidden
    attention = (h * q_rank + q_rank + q_rank * heads * (head_dim + rope_dim)
                 + h * (kv_rank + rope_dim) + kv_rank + kv_rank * heads * (head_dim + v_head_dim)
                 + heads * v_head_dim * h)
    expert, dense = 3 * h * expert_ffn, 3 * h * dense_ffn
    router, norms = h * routed + routed, 2 * h
    moe_layers = layers - dense_layers
    embeddings = 2 * vocab * h + h
    common = layers * (attention + norms) + dense_layers * dense + moe_layers * (router + shared * expert) + embeddings
    total = common + moe_layers * routed * expert
    active = common + moe_layers * top_k * expert
    return {"attention_per_layer": attention, "expert": expert, "dense_ffn": dense, "router_per_layer": router,
            "embeddings": embeddings, "moe_layers": moe_layers, "total": total, "active": active}
