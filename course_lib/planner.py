"""A layout planner: which ``(dp, tp, pp, micro-batch)`` to choose for a model on a cluster (notebook 09).

Given a GPT (:class:`ModelSpec`) and a GPU cluster (:class:`ClusterSpec`), :func:`enumerate_layouts`
lists every valid layout (:class:`Layout`), and for each :func:`layout_memory` predicts the bytes on the
busiest GPU, :func:`layout_traffic` / :func:`total_traffic` the bytes every axis carries and
:func:`layout_step_time` the seconds of one step; :func:`plan_layouts` does all of it and sorts the
layouts (those that fit first, fastest first). :data:`GPT3_175B` and :func:`dgx_a100_cluster` are the
notebook's example. Layouts are placed on a row-major ``(dp, pp, tp)`` mesh, as
:class:`course_lib.mesh.Mesh` numbers its ranks.

Context parallelism (notebook 15) is opt-in: ``plan_layouts(..., cp=(1, 2, 4, ...))`` /
``enumerate_layouts(..., cp=...)`` also try splitting each sequence over ``cp`` ranks (mesh
``(dp, pp, cp, tp)``, :data:`course_lib.mesh.CP_AXES`). A layout's ``cp`` (default 1, which changes
nothing) divides its activations by ``cp`` (every rank keeps ``s/cp`` tokens' worth), adds the ring's
K/V traffic (:func:`course_lib.context_parallel.ring_attention_bytes`, per layer and micro-batch) as
the ``"cp"`` entry of the traffic and the step time, and averages the gradients over the ``dp * cp``
ranks that saw different tokens. :data:`LLAMA3_405B_128K` on :func:`h100_cluster` is notebook 15's example.

Calibrating a machine for the planner, inside a worker: :func:`measure_link` fits the latency and the
bandwidth of a group's links, :func:`measure_flops` measures the FLOP/s a rank gets while all compute.
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist

from course_lib import collectives

__all__ = [
    "ModelSpec", "ClusterSpec", "Layout", "enumerate_layouts", "layout_memory", "layout_traffic", "total_traffic",
    "measure_link", "measure_flops",
    "layout_step_time", "plan_layouts", "GPT3_175B", "dgx_a100_cluster", "LLAMA3_405B_128K", "h100_cluster",
]


# --------------------------------------------------------------------------- the planner
@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a GPT: ``n_layer``, ``hidden``, ``heads``, ``seq``
    (sequence length), ``vocab``, ``global_batch`` (sequences per optimizer step) and, optionally,
    ``n_params`` (default: :func:`course_lib.estimate.gpt_param_count` with the vocabulary and ``seq``
    learned positions, the LM head tied) and ``kv_heads`` (key/value heads of grouped-query
    attention; default 0: as many as ``heads``), which sets the bytes context parallelism's ring moves."""
    name: str
    n_layer: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    global_batch: int
    n_params: float = 0.0
    kv_heads: int = 0

    def __post_init__(self):
        for k in ("n_layer", "hidden", "heads", "seq", "vocab", "global_batch"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"ModelSpec.{k} must be a positive int, got {v!r}")
        kv = self.kv_heads
        if isinstance(kv, bool) or not isinstance(kv, numbers.Integral) or kv < 0 or (kv and self.heads % kv):
            raise ValueError(f"ModelSpec.kv_heads must be 0 (as many as the heads) or divide heads={self.heads}, "
                             f"got {kv!r}")
        if not self.n_params:
            from course_lib.estimate import gpt_param_count
            object.__setattr__(self, "n_params", float(gpt_param_count(self.n_layer, self.hidden, self.vocab, self.seq)))


@dataclass(frozen=True)
class ClusterSpec:
    """A GPU cluster: ``nodes`` x ``gpus_per_node``; per GPU ``memory`` (bytes), ``peak_flops`` (dense
    16-bit FLOP/s) and ``efficiency`` (the fraction of peak its matmuls reach); per GPU and direction
    ``intra_bw`` (NVLink, bytes/s) and ``inter_bw`` (its network adapter, bytes/s); latencies (alpha,
    seconds) ``intra_latency`` / ``inter_latency``."""
    name: str
    nodes: int
    gpus_per_node: int
    memory: float
    peak_flops: float
    efficiency: float
    intra_bw: float
    inter_bw: float
    intra_latency: float = 5e-6
    inter_latency: float = 10e-6

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def dgx_a100_cluster(nodes: int, memory_gb: float = 80.0, efficiency: float = 0.5) -> ClusterSpec:
    """DGX A100 nodes: 8 A100s, 312 TFLOP/s dense bf16 each, NVLink 3 at 300 GB/s per direction per GPU,
    one InfiniBand HDR adapter (200 Gb/s = 25 GB/s) per GPU (NVIDIA A100 datasheet, DGX A100 user
    guide; the figures notebook 07 uses). ``efficiency``: the matmuls' fraction of peak (an assumption)."""
    return ClusterSpec(f"{nodes} x DGX A100 ({memory_gb:g} GB)", nodes, 8, memory_gb * 1e9, 312e12,
                       efficiency, 300e9, 25e9)


def h100_cluster(nodes: int, efficiency: float = 0.5) -> ClusterSpec:
    """Nodes of 8 H100 SXM GPUs: 80 GB, 989 TFLOP/s dense bf16 each (NVIDIA H100 datasheet), NVLink 4
    at 450 GB/s per direction per GPU, one 400 Gb/s (50 GB/s) network adapter per GPU (the
    interconnect of Llama 3's clusters, Dubey et al. 2024, arXiv:2407.21783, §3.3.1). ``efficiency``:
    the matmuls' fraction of peak (an assumption; Llama 3 405B reached 38-43 % MFU, Table 4)."""
    return ClusterSpec(f"{nodes} x 8 H100 (80 GB)", nodes, 8, 80e9, 989e12, efficiency, 450e9, 50e9)


#: GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, d_model 12288, 96 heads, context 2048,
#: batch 3.2M tokens = 1536 sequences of 2048 (as Narayanan et al. 2021 train it); GPT-2's 50257-token
#: vocabulary.
GPT3_175B = ModelSpec("GPT-3 175B", n_layer=96, hidden=12288, heads=96, seq=2048, vocab=50257,
                      global_batch=1536)

#: Llama 3 405B in its long-context stage (Dubey et al. 2024, arXiv:2407.21783): model dimension 16384,
#: 128 heads, 8 key/value heads, a 128,000-token vocabulary (Table 3), 405 B parameters; sequences of
#: 131,072 tokens, 16 M tokens per batch = 128 sequences (Table 4). Llama 3 has 126 layers; the planner
#: splits layers into equal pipeline stages, and 126 does not split over 16 stages, so it is given 128
#: (1.6 % more compute than the real model).
LLAMA3_405B_128K = ModelSpec("Llama 3 405B at 128k", n_layer=128, hidden=16384, heads=128, seq=131072,
                             vocab=128000, global_batch=128, n_params=405e9, kv_heads=8)


@dataclass
class Layout:
    """One candidate: degrees ``dp``, ``tp``, ``pp``, ``micro_batch`` (sequences per micro-batch) and
    ``m`` (micro-batches per step per replica), and ``cp`` (context parallelism: ranks one sequence
    is split over; default 1); filled in by :func:`plan_layouts`: ``memory`` and ``time`` (dicts,
    bytes and seconds), ``fits`` and ``axis_links`` (``{axis: "nvlink"/"network"}``)."""
    dp: int
    tp: int
    pp: int
    micro_batch: int
    m: int
    cp: int = 1
    memory: dict = field(default_factory=dict)
    time: dict = field(default_factory=dict)
    traffic: dict = field(default_factory=dict)
    fits: bool = True
    axis_links: dict = field(default_factory=dict)

    @property
    def degrees(self) -> tuple[int, int, int]:
        return (self.dp, self.tp, self.pp)

    def __str__(self) -> str:
        s = f"dp={self.dp:<3d} tp={self.tp:<2d} pp={self.pp:<3d} "
        if self.cp > 1:
            s += f"cp={self.cp:<3d} "
        s += f"micro-batch={self.micro_batch:<2d} m={self.m:<4d}"
        if self.memory:
            s += f" memory {self.memory['total'] / 1e9:6.1f} GB"
        if self.time:
            s += f"  step {self.time['step']:7.2f} s"
        return s


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(model: ModelSpec, world_size: int, micro_batches: Iterable[int] | None = None,
                      cp: Iterable[int] = (1,)) -> list[Layout]:
    """Every valid ``(dp, tp, pp, micro_batch)`` (and ``cp``) for ``model`` on ``world_size`` GPUs:

    * ``dp * tp * pp * cp == world_size``, ``cp`` among the degrees ``cp`` (default only 1: no
      context parallelism); ``2 cp`` divides the sequence (the zig-zag layout's chunks);
    * ``tp`` divides the heads (each rank gets whole heads) and the hidden size;
    * ``pp`` divides the layers (equal stages, as Megatron-LM requires);
    * ``dp`` divides the global batch, and ``micro_batch`` divides each replica's ``global_batch / dp``
      sequences (``m = global_batch / (dp * micro_batch)`` micro-batches);
    * ``micro_batch`` among ``micro_batches`` when given (default: every divisor).

    Ordered by (dp, tp, pp, micro_batch, cp)."""
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    cps = sorted(set(cp))
    if not cps or any(isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 1 for c in cps):
        raise ValueError(f"cp is a list of context-parallel degrees (positive ints, e.g. (1, 2, 4)), got {cp!r}")
    allowed = None if micro_batches is None else set(micro_batches)
    out = []
    for c in cps:
        if world_size % c or (c > 1 and model.seq % (2 * c)):
            continue
        for tp in _divisors(world_size // c):
            if model.heads % tp or model.hidden % tp:
                continue
            for pp in _divisors(world_size // (c * tp)):
                if model.n_layer % pp:
                    continue
                dp = world_size // (c * tp * pp)
                if model.global_batch % dp:
                    continue
                per_replica = model.global_batch // dp
                for mb in _divisors(per_replica):
                    if allowed is not None and mb not in allowed:
                        continue
                    out.append(Layout(dp, tp, pp, mb, per_replica // mb, cp=c))
    return sorted(out, key=lambda l: (l.dp, l.tp, l.pp, l.micro_batch, l.cp))


def layout_memory(model: ModelSpec, layout: Layout, zero_stage: int = 1, sequence_parallel: bool = True,
                  recompute: str = "selective", grad_bytes: int = 4) -> dict:
    """Predicted bytes on the busiest GPU (the first pipeline stage) with mixed-precision Adam:

    * model states (notebook 06): :func:`course_lib.estimate.zero_model_state_bytes` of the parameters
      split ``tp * pp`` ways, with ZeRO ``zero_stage`` over the ``dp`` replicas, and ``grad_bytes`` per
      gradient value: 4 for Megatron-LM's fp32 main gradients (bf16 parameters, gradients accumulated
      and reduced in fp32: its distributed optimizer, ``zero_stage=1``, holds ``6 + 12/d`` bytes per
      parameter, Megatron-Core's distributed-optimizer docs), 2 for the ZeRO paper's accounting
      (``2 + 2 + 12/d``);
    * activations (notebook 01 / 07, Korthikanti et al. 2022 Table 2): per layer and micro-batch
      :func:`course_lib.estimate.activation_bytes_per_layer`; under 1F1B the first stage holds
      ``min(pp, m)`` micro-batches of its ``L / pp`` layers (Korthikanti §4.2.3: ``L`` layers' worth
      when ``m >= pp``, whatever ``pp``); with context parallelism each rank keeps ``s/cp`` of every
      sequence's tokens, so everything is divided by ``cp`` (the ``5as/h`` term too: a rank's scores
      are its ``s/cp`` queries against all ``s`` keys). Optimizer states are sharded over the
      ``dp * cp`` ranks that average gradients (Megatron-LM's distributed optimizer does so).

    Returns ``{"parameters", "gradients", "optimizer_states", "activations", "total"}``."""
    from course_lib.estimate import activation_bytes_per_layer, zero_model_state_bytes

    if grad_bytes not in (2, 4):
        raise ValueError(f"grad_bytes is 2 (bf16 gradients) or 4 (fp32 main gradients), got {grad_bytes!r}")
    states = zero_model_state_bytes(model.n_params / (layout.tp * layout.pp), zero_stage, layout.dp * layout.cp)
    states["gradients"] *= grad_bytes / 2            # zero_model_state_bytes counts 2-byte gradients
    per_layer = activation_bytes_per_layer(model.seq, layout.micro_batch, model.hidden, model.heads,
                                           tp=layout.tp, sequence_parallel=sequence_parallel and layout.tp > 1,
                                           recompute=recompute)
    in_flight = min(layout.pp, layout.m)
    out = dict(states)
    out["activations"] = model.n_layer / layout.pp * in_flight * per_layer / layout.cp
    out["total"] = sum(out.values())
    return out


def layout_traffic(model: ModelSpec, layout: Layout, stage: int = 0, bytes_per_value: int = 2,
                   header_bytes: int = 0) -> dict:
    """Bytes one GPU of pipeline ``stage`` sends per optimizer step on each axis, ring collectives:

    * ``tp``: 4 all-reduces per layer and micro-batch of ``b s h`` values (notebook 07) over the
      stage's ``L / pp`` layers and ``m`` micro-batches, plus one for the vocabulary-parallel embedding
      (first stage, forward) and one for the LM head (last stage, backward), plus the loss's two
      all-reduces of one value per token (last stage);
    * ``pp``: an activation to the next stage and a gradient to the previous one, ``b s h`` values
      each per micro-batch, plus ``header_bytes`` once per neighbour (the course's runner sends a
      72-byte shape header);
    * ``dp``: one all-reduce of the GPU's gradients (``n_params / (tp pp)`` values; also what ZeRO-1's
      reduce-scatter + all-gather move). Replicated layer norms and biases are not counted;
    * ``tied``: with ``pp > 1`` the first and last stages sum the tied embedding's gradient
      (``V h / t`` values, a ring of 2);
    * ``cp`` (context parallelism, ``layout.cp > 1``): per layer and micro-batch the ring's forward and
      backward bytes, :func:`course_lib.context_parallel.ring_attention_bytes` with the rank's
      ``kv_heads / t`` key/value heads (at least 1) of ``h / a`` dimensions. With ``cp > 1`` the tp and
      pp messages carry ``s/cp`` tokens and the dp all-reduce runs over ``dp * cp`` ranks.

    Returns ``{"tp", "pp", "dp", "tied", "cp"}`` in bytes."""
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage must be in [0, {layout.pp}), got {stage!r}")
    from course_lib.collectives import ring_all_reduce_bytes as ring
    from course_lib.tensor_parallel import tp_bytes_per_layer

    first, last = stage == 0, stage == layout.pp - 1
    b, t, m = layout.micro_batch, layout.tp, layout.m
    s = model.seq // layout.cp                                  # this rank's tokens of each sequence
    n_mb = b * s * model.hidden * bytes_per_value
    layers = model.n_layer / layout.pp
    per_all_reduce = tp_bytes_per_layer(b, s, model.hidden, t, bytes_per_value)["sent_per_all_reduce"]
    tp = m * (4 * layers + first + last) * per_all_reduce + last * m * 2 * ring(b * s * bytes_per_value, t)
    neighbours = (not last) + (not first) if layout.pp > 1 else 0
    return {
        "tp": tp,
        "pp": neighbours * (m * n_mb + header_bytes),
        "dp": ring(model.n_params / (t * layout.pp) * bytes_per_value, layout.dp * layout.cp),
        "tied": ring(model.vocab * model.hidden / t * bytes_per_value, 2) if layout.pp > 1 and (first or last) else 0.0,
        "cp": m * layers * _ring_bytes_per_layer(model, layout, bytes_per_value),
    }


def _ring_bytes_per_layer(model: ModelSpec, layout: Layout, bytes_per_value: int) -> float:
    """Bytes one rank's ring attention sends in one layer and micro-batch, forward + backward."""
    if layout.cp == 1:
        return 0.0
    from course_lib.context_parallel import ring_attention_bytes
    kv_local = max((model.kv_heads or model.heads) // layout.tp, 1)   # K/V heads on one tp rank
    got = ring_attention_bytes(layout.micro_batch, kv_local, model.seq, model.hidden // model.heads, layout.cp,
                               bytes_per_value=bytes_per_value)
    return float(got["forward"] + got["backward"])


def total_traffic(model: ModelSpec, layout: Layout, bytes_per_value: int = 2, header_bytes: int = 0) -> dict:
    """:func:`layout_traffic` summed over every GPU of the layout (all stages, ``dp * cp * tp`` GPUs each)."""
    out = dict.fromkeys(("tp", "pp", "dp", "tied", "cp"), 0.0)
    for s in range(layout.pp):
        for k, v in layout_traffic(model, layout, s, bytes_per_value, header_bytes).items():
            out[k] += layout.dp * layout.cp * layout.tp * v
    return out


def _axis_links(layout: Layout, gpus_per_node: int) -> dict:
    """``{axis: "nvlink" | "network"}``: does every group of the axis sit inside one node? Ranks are
    placed row-major (dp, pp, tp), or (dp, pp, cp, tp) with ``cp > 1``, ``gpus_per_node`` consecutive
    ranks per node; the ``cp`` entry is there only when ``cp > 1``."""
    world = layout.dp * layout.tp * layout.pp * layout.cp
    out = {}
    axes = [("dp", layout.dp, layout.tp * layout.cp * layout.pp), ("pp", layout.pp, layout.tp * layout.cp),
            ("tp", layout.tp, 1)]
    if layout.cp > 1:
        axes.append(("cp", layout.cp, layout.tp))
    for a, k, stride in axes:
        # a group is {first + j * stride}; its first members are the ranks whose coordinate on `a` is 0
        firsts = (r for r in range(world) if (r // stride) % k == 0)
        inside = all(f // gpus_per_node == (f + (k - 1) * stride) // gpus_per_node for f in firsts)
        out[a] = "nvlink" if inside else "network"
    return out


def layout_step_time(model: ModelSpec, cluster: ClusterSpec, layout: Layout, bytes_per_value: int = 2) -> dict:
    """Predicted seconds of one optimizer step (assumptions stated; nothing overlaps):

    * ``compute``: ``m`` micro-batches of the stage's share of the training FLOPs
      (:func:`course_lib.estimate.gpt_training_flops` / (tp pp)) at ``peak_flops * efficiency``;
      recomputation is not counted (selective recomputation adds s / (3 (6h + s)) of a step, 0.9 % for
      GPT-3 175B at s = 2048; Korthikanti et al. §5 quote 2.7 %, the same FLOPs relative to the forward);
    * ``tp``: the first stage's all-reduces per micro-batch (4 per layer and the embedding's), alpha-beta
      (notebook 03, :func:`course_lib.tensor_parallel.tp_comm_seconds`) on NVLink when the tp group is
      inside a node, else on the network;
    * ``pp``: each of the ``m + pp - 1`` pipeline slots waits for one activation hop and one gradient hop;
    * ``bubble``: ``(pp - 1)`` slots of a micro-batch's compute + tp time (1F1B / GPipe, notebook 08);
    * ``dp``: one ring all-reduce of the GPU's gradients after the backward;
    * ``cp`` (context parallelism, ``layout.cp > 1``; 0 otherwise): per layer and micro-batch the ring's
      ``3 (cp - 1)`` messages (K/V forward, K/V and dK/dV backward) of :func:`layout_traffic`'s bytes,
      counted as exposed like everything here (the ring is built to hide them behind the attention:
      an overlap model takes them out). With ``cp > 1`` the compute, tp and pp terms are those of
      ``s/cp`` tokens, the bubble includes the cp time and the dp all-reduce spans ``dp * cp`` ranks.

    Returns ``{"compute", "tp", "pp", "bubble", "dp", "cp", "step"}``."""
    from course_lib.collectives import ring_all_reduce_bytes as ring
    from course_lib.estimate import gpt_training_flops
    from course_lib.tensor_parallel import tp_comm_seconds

    links = _axis_links(layout, cluster.gpus_per_node)

    def link(axis):
        return ((cluster.intra_bw, cluster.intra_latency) if links[axis] == "nvlink"
                else (cluster.inter_bw, cluster.inter_latency))

    cp = layout.cp
    s = model.seq // cp                                   # this rank's tokens of each sequence
    flops_mb = gpt_training_flops(model.n_layer, layout.micro_batch, model.seq, model.hidden,
                                  model.vocab) / (layout.tp * layout.pp * cp)
    t_mb = flops_mb / (cluster.peak_flops * cluster.efficiency)
    n_mb = layout.micro_batch * s * model.hidden * bytes_per_value
    layers = model.n_layer / layout.pp
    bw, lat = link("tp")
    n_ar = 4 * layers + 1 + (layout.pp == 1)     # the first stage's: its layers', the embedding's (and the head's)
    # tp_comm_seconds is a layer's 4 all-reduces of b s h values: a quarter of it per all-reduce
    tp_mb = n_ar * tp_comm_seconds(layout.micro_batch, s, model.hidden, layout.tp, bw, lat,
                                   bytes_per_value) / 4 if layout.tp > 1 else 0.0
    cp_mb = 0.0
    if cp > 1:
        bw, lat = link("cp")
        cp_mb = layers * (3 * (cp - 1) * lat + _ring_bytes_per_layer(model, layout, bytes_per_value) / bw)
    bw, lat = link("pp")
    hop = 2 * (lat + n_mb / bw) if layout.pp > 1 else 0.0
    # the gradients' all-reduce spans dp * cp ranks: over the network if either axis leaves the node
    bw, lat = link("dp")
    if cp > 1 and links["cp"] == "network":
        bw, lat = cluster.inter_bw, cluster.inter_latency
    grads = model.n_params / (layout.tp * layout.pp) * bytes_per_value
    n_grad = layout.dp * cp
    t_dp = (2 * (n_grad - 1) * lat + ring(grads, n_grad) / bw) if n_grad > 1 else 0.0
    out = {"compute": layout.m * t_mb, "tp": layout.m * tp_mb,
           "pp": (layout.m + layout.pp - 1) * hop,
           "bubble": (layout.pp - 1) * (t_mb + tp_mb + cp_mb), "dp": t_dp, "cp": layout.m * cp_mb}
    out["step"] = sum(out.values())
    return out


def plan_layouts(model: ModelSpec, cluster: ClusterSpec, micro_batches: Iterable[int] | None = (1, 2, 4, 8),
                 zero_stage: int = 1, sequence_parallel: bool = True, recompute: str = "selective",
                 reserve: float = 0.1, grad_bytes: int = 4, cp: Iterable[int] = (1,)) -> list[Layout]:
    """Every valid layout of ``model`` on ``cluster`` (:func:`enumerate_layouts`) with its predicted
    memory (:func:`layout_memory`), traffic (:func:`layout_traffic`) and step time
    (:func:`layout_step_time`); ``fits`` when the memory is within ``(1 - reserve)`` of the GPU's
    (a share kept for buffers and fragmentation). ``grad_bytes`` as in :func:`layout_memory` (default 4:
    Megatron-LM's fp32 main gradients). ``cp``: the context-parallel degrees to try (default only 1).
    Sorted: layouts that fit first, fastest first."""
    if not 0 <= reserve < 1:
        raise ValueError(f"reserve is a fraction of the GPU's memory in [0, 1), got {reserve!r}")
    out = []
    for lay in enumerate_layouts(model, cluster.world_size, micro_batches, cp):
        lay.memory = layout_memory(model, lay, zero_stage, sequence_parallel, recompute, grad_bytes)
        lay.traffic = layout_traffic(model, lay)
        lay.time = layout_step_time(model, cluster, lay)
        lay.fits = lay.memory["total"] <= (1 - reserve) * cluster.memory
        lay.axis_links = _axis_links(lay, cluster.gpus_per_node)
        out.append(lay)
    return sorted(out, key=lambda l: (not l.fits, l.time["step"]))


# --------------------------------------------------------------------------- calibrating a machine
def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def measure_link(group=None, sizes: tuple[int, int] = (64, 4 << 20), repeats: int = 5,
                 device: torch.device | str | None = None) -> tuple[float, float]:
    """``(alpha, bandwidth)`` of the links between the ranks of ``group`` (every rank calls it), fitted
    to the course's ring all-reduce: ``t(n) = 2 (N-1) alpha + 2 (N-1)/N n / bandwidth`` through the
    median times of a small and a large float32 message (bytes ``sizes``). On the virtual cluster
    this measures loopback TCP and the processes' scheduling, not a network. The messages are on
    ``device`` (default: :func:`course_lib.collectives.comm_device` of ``group``, the GPU under NCCL)."""
    N = dist.get_world_size(group)
    if N < 2:
        raise ValueError("measure_link needs a group of at least 2 ranks")
    device = collectives.comm_device(group) if device is None else torch.device(device)
    times = []
    for nbytes in sizes:
        t = torch.zeros(max(nbytes // 4, N), device=device)
        collectives.ring_all_reduce(t, group=group)           # warm-up
        ts = []
        for _ in range(repeats):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            collectives.ring_all_reduce(t, group=group)
            ts.append(time.perf_counter() - t0)
        times.append(_median(ts))
    (n0, n1), (t0, t1) = [max(n // 4, N) * 4 for n in sizes], times
    inv_bw = max((t1 - t0) / (2 * (N - 1) / N * (n1 - n0)), 1e-15)
    alpha = max((t0 - 2 * (N - 1) / N * n0 * inv_bw) / (2 * (N - 1)), 0.0)
    return alpha, 1.0 / inv_bw


def measure_flops(fn, flops: float, group=None, repeats: int = 5) -> float:
    """FLOP/s of ``fn()`` (which does ``flops`` floating-point operations) when every rank of ``group``
    runs it at the same moment: the rate a rank gets while the others compute too (on the virtual
    cluster they share the machine's cores). Median of ``repeats`` after one warm-up."""
    fn()
    ts = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return flops / _median(ts)

