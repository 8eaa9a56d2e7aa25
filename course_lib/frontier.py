"""The frontier recipe: every technique of the course in one training run (notebook 14).

A frontier model's training run uses every trick at once: BF16 mixed precision, data parallelism
with ring all-reduce over thousands of GPUs, tensor parallelism inside a node, pipeline parallelism
across nodes, gradient checkpointing to save memory, MoE for parameter efficiency, and periodic
checkpoints for fault tolerance (Llama 3's report, Dubey et al. 2024, section 3.3, describes such a
stack, without MoE; DeepSeek-V3's, arXiv 2412.19437, section 3, with it). :class:`FrontierGPT` is that, at toy size,
from the course's own modules and nothing else:

=========================  ==========================================================  ==============
technique                   here                                                         notebook
=========================  ==========================================================  ==============
BF16 mixed precision        bf16 parameters, activations and their messages; gradients   02, 06
                            accumulated and reduced in fp32; fp32 master weights and
                            Adam states; the loss in fp32
ZeRO data parallelism       ``ZeRO(stage=1)`` over the ``dp`` group: gradients           04, 06
                            reduce-scattered, Adam on this rank's slice, all-gathered
gradient clipping           by the global norm over every shard (``clip``), each          04, 06
                            element counted once
tensor parallelism          ``ParallelBlock`` / vocabulary-parallel embedding and loss   07
pipeline parallelism        1F1B over the ``pp`` group, ``micro`` micro-batches          08
3D layout                   ``Mesh`` / ``init_process_mesh`` / ``HybridGPT``             09
mixture of experts          the last block's FFN is an ``MoELayer`` (top-k of E)         10
activation checkpointing    every block's forward re-run in the backward (``checkpoint``) 11
fault tolerance             sharded ZeRO checkpoints (``save_sharded``), resumed exactly  12
=========================  ==========================================================  ==============

Choices and limits, named: ZeRO stage 1 only. This is a property of the course's ZeRO, not of ZeRO:
its stages 2/3 reduce each gradient as soon as it is ready, which under pipelining (gradients accumulate
over micro-batches) would fire on the first micro-batch; DeepSpeed's pipeline engine has the same limit,
and Megatron-LM's distributed optimizer is stage 1. Production does shard parameters under pipelining
by reducing once per step: Llama 3 trained with FSDP and 16 pipeline stages (Dubey et al. 2024,
section 3.3.2), and torchtitan composes FSDP2 with ``torch.distributed.pipelining``. The MoE layer is replicated across the ``dp`` ranks (no expert
parallelism: ZeRO shards its optimizer states like any other weight; notebook 10 shows expert
parallelism) and across the ``tp`` ranks (every ``tp`` rank computes it on the same replicated input);
no load-balancing loss is added (its routing is top-k without capacity limits, so no token drops).
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib.collectives import comm_device
from course_lib.hybrid_gpt import HybridGPT
from course_lib.mesh import ProcessMesh

__all__ = ["Recipe", "make_model", "make_batches", "ParallelMoEBlock", "Recomputed", "FrontierGPT",
           "train", "train_reference", "step_flops"]


@dataclass
class Recipe:
    """A frontier-style run at toy size. ``dp * pp * tp`` ranks; the global batch of ``batch``
    sequences is split over ``dp`` and each replica's share into ``micro`` micro-batches."""

    dp: int = 2
    pp: int = 2
    tp: int = 2
    vocab: int = 64
    block: int = 16
    layers: int = 4
    heads: int = 2
    hidden: int = 32
    experts: int = 4
    top_k: int = 2
    batch: int = 16
    micro: int = 4
    steps: int = 12
    lr: float = 3e-3
    bf16: bool = True
    clip: float | None = 1.0
    recompute: bool = True
    checkpoint_every: int = 4
    builtin: bool = False
    seed: int = 0

    def __post_init__(self):
        for k in ("dp", "pp", "tp", "layers", "heads", "hidden", "experts", "top_k", "batch", "micro", "steps",
                  "checkpoint_every"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Recipe.{k} must be a positive int, got {v!r}")
        if self.clip is not None and (isinstance(self.clip, bool) or not isinstance(self.clip, (int, float))
                                      or not self.clip > 0):
            raise ValueError(f"Recipe.clip must be a positive number (the largest global gradient norm) or "
                             f"None (no clipping), got {self.clip!r}")
        if self.top_k > self.experts:
            raise ValueError(f"Recipe: top_k={self.top_k} > experts={self.experts}")
        if self.batch % (self.dp * self.micro):
            raise ValueError(f"Recipe: batch={self.batch} must split into dp={self.dp} replicas of "
                             f"micro={self.micro} equal micro-batches (a multiple of {self.dp * self.micro})")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32


def make_model(recipe: Recipe) -> nn.Module:
    """The seeded fp32 TinyGPT every rank builds, its last block's FFN replaced by an MoE layer."""
    from course_lib.models import TinyGPT
    from course_lib.moe import MoEBlock, MoELayer
    torch.manual_seed(recipe.seed)
    model = TinyGPT(vocab_size=recipe.vocab, block_size=recipe.block, n_layer=recipe.layers,
                    n_head=recipe.heads, n_embd=recipe.hidden)
    with torch.no_grad():
        model.wte.weight.mul_(0.1)       # small tied embeddings: a first loss near ln(vocab), not 20
    h = recipe.hidden
    model.blocks[-1] = MoEBlock(model.blocks[-1], MoELayer(h, 4 * h, recipe.experts, recipe.top_k))
    return model


def make_batches(recipe: Recipe) -> list:
    """One seeded ``(x, y)`` batch per step (the same on every rank)."""
    from course_lib.models import make_tokens
    return [make_tokens(recipe.batch, recipe.block, recipe.vocab, seed=recipe.seed + 1 + i)
            for i in range(recipe.steps)]


class ParallelMoEBlock(nn.Module):
    """An MoE block under tensor parallelism: the attention is sharded over ``tp`` (07); the MoE FFN is
    replicated on every ``tp`` rank and runs on the replicated hidden state."""

    def __init__(self, block: nn.Module, tp_group, builtin: bool):
        super().__init__()
        from course_lib.tensor_parallel import ParallelSelfAttention
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn = ParallelSelfAttention.from_attention(block.attn, tp_group, builtin=builtin)
        self.moe = copy.deepcopy(block.moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class Recomputed(nn.Module):
    """``block`` whose forward is re-run in the backward (:func:`course_lib.recompute.checkpoint`):
    only its input is kept between the forward and the backward."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from course_lib.recompute import checkpoint
        return checkpoint(self.block, x)


class FrontierGPT(HybridGPT):
    """:class:`course_lib.hybrid_gpt.HybridGPT` plus the rest of the recipe (see the module docstring):
    recomputed blocks, an MoE block, and ``ZeRO(stage=1)`` with bf16 parameters over the ``dp`` group
    as the optimizer, its gradients accumulated and reduced in fp32, clipped by their global norm.
    ``train_step(x, y)`` does one step; ``save`` / ``load`` write and read sharded checkpoints (every
    rank its ZeRO slice, :func:`course_lib.checkpoint.save_sharded`)."""

    def __init__(self, model: nn.Module, pmesh: ProcessMesh, recipe: Recipe):
        from course_lib.zero import ZeRO
        self.recipe = recipe
        super().__init__(model, pmesh, schedule="1f1b", builtin=recipe.builtin)
        dp_group = pmesh.group("dp")
        self.zero = ZeRO(self.module, stage=1, lr=recipe.lr, group=dp_group,
                         param_dtype=torch.bfloat16 if recipe.bf16 else None, reduce_dtype=torch.float32,
                         builtin=recipe.builtin, src=dist.get_global_rank(dp_group, 0))
        self.key = f"stage{self.stage}.tp{pmesh.local_rank('tp')}"
        self.last_grad_norm: float | None = None

    def counted_elsewhere(self) -> list[nn.Parameter]:
        """This rank's parameters whose gradient another rank counts in the global norm: on tp ranks
        other than 0, every parameter tensor parallelism replicates (layer norms, position
        embedding, row-parallel biases, the MoE layer); on the last stage of a pipeline, its copy of
        the tied embedding (the first stage counts it). Megatron-LM counts the same way."""
        from course_lib.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
        sharded = set()
        for m in self.module.modules():
            if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding)):
                sharded.update(id(p) for p in m.parameters(recurse=False))
            elif isinstance(m, RowParallelLinear):
                sharded.add(id(m.weight))
        tied = {id(p) for p in self._tied()} if self.last and not self.first else set()
        head = self.module[-1].weight if self.last else None
        if head is not None:
            sharded.add(id(head))              # the LM head is the vocabulary-parallel embedding's shard
        out = []
        for p in self.parameters():
            replicated_over_tp = id(p) not in sharded
            if (replicated_over_tp and self.pmesh.local_rank("tp") != 0) or id(p) in tied:
                out.append(p)
        return out

    def _shard_block(self, block: nn.Module, tp_group) -> nn.Module:
        from course_lib.moe import MoEBlock
        if isinstance(block, MoEBlock):
            sharded = ParallelMoEBlock(block, tp_group, self.builtin)
        else:
            sharded = super()._shard_block(block, tp_group)
        return Recomputed(sharded) if self.recipe.recompute else sharded

    def loss_fn(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return super().loss_fn(logits.float(), target)      # the loss (and its softmax) in fp32

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """One optimizer step on the global batch; returns this replica's loss on last-stage ranks."""
        self.zero.zero_grad()
        loss = self.forward_backward(x, y, self.recipe.micro, sync_dp=False)
        if self.recipe.clip is not None:
            norm = self.zero.clip_grad_norm_(self.recipe.clip, norm_group=dist.group.WORLD,
                                             skip=self.counted_elsewhere())
            self.last_grad_norm = float(norm)
        self.zero.step()
        return loss

    def save(self, manager, step: int, extra: dict | None = None) -> dict:
        """Every rank writes its ZeRO slice (keys prefixed by its stage and tp rank); collective."""
        from course_lib.checkpoint import save_sharded
        sd = self.zero.sharded_state_dict()
        state = {"shards": {f"{self.key}/{k}": v for k, v in sd["shards"].items()},
                 "lengths": {f"{self.key}/{k}": v for k, v in sd["lengths"].items()},
                 "replicated": dict(extra or {}), "local": {"zero": sd["replicated"]}}
        return save_sharded(manager, step, state, meta={"recipe": asdict(self.recipe)})

    def load(self, manager) -> tuple[int, dict]:
        """Load the newest intact checkpoint (same layout); return ``(step, extra)``. Collective."""
        from course_lib.checkpoint import CheckpointError, load_sharded
        ck = load_sharded(manager)
        saved = ck.manifest["meta"].get("recipe", {})
        mine = asdict(self.recipe)
        layout = ("dp", "pp", "tp", "layers", "hidden", "heads", "vocab", "experts")
        if any(saved.get(k) != mine[k] for k in layout):
            raise CheckpointError(f"checkpoint step {ck.step} is from another layout or model: "
                                  + ", ".join(f"{k} {saved.get(k)} vs {mine[k]}" for k in layout
                                              if saved.get(k) != mine[k]))
        self.zero.load_sharded_state_dict(lambda k, a, b: ck.fetch(f"{self.key}/{k}", a, b),
                                          ck.local(self.pmesh.rank)["zero"])
        return ck.step, ck.replicated


def _mean_loss(loss: float | None, h: FrontierGPT) -> float:
    """The global batch's mean loss on every rank: the last stage's tp-rank-0 ranks hold one replica each."""
    mine = loss if (loss is not None and h.pmesh.local_rank("tp") == 0) else 0.0
    t = torch.tensor([mine], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t)
    return float(t) / h.dp


def train(rank: int, world_size: int, attempt: int, directory: str, recipe: dict | Recipe, *,
          plan=None, measure_step: int | None = None, device: torch.device | str | None = None) -> dict:
    """One rank of the frontier run; resumes from the newest checkpoint in ``directory`` (as
    :func:`course_lib.fault.run_with_restarts` expects) and saves every ``recipe.checkpoint_every``
    steps. ``plan``: a :class:`course_lib.fault.FaultPlan`. At ``measure_step`` (if given and run in this
    attempt) the step is traced (:mod:`course_lib.trace`), its bytes per axis counted
    (:class:`~course_lib.mesh.CommMeter`) and its live tensor bytes tracked (:mod:`course_lib.memory`).
    The model and the batches are on ``device`` (``None``: :func:`course_lib.collectives.comm_device`,
    the rank's GPU under NCCL, else the CPU).

    Returns ``losses`` (the global mean loss of every step since step 0, carried in the checkpoints),
    ``grad_norms`` (the global gradient norm of each step of this attempt, before clipping; empty
    without clipping), ``resumed_from``, ``seconds`` (per step of this attempt), ``state_bytes`` (this rank's model states
    after a step), ``n_params`` (this rank's), and at ``measure_step`` ``events``, ``bytes`` and ``peak_bytes``.
    """
    from course_lib import trace
    from course_lib.checkpoint import CheckpointManager, agreed_latest
    from course_lib.memory import track_memory
    from course_lib.mesh import CommMeter, init_process_mesh

    r = recipe if isinstance(recipe, Recipe) else Recipe(**recipe)
    if world_size != r.world_size:
        raise ValueError(f"the recipe needs dp*pp*tp = {r.world_size} ranks, the job has {world_size}")
    device = comm_device() if device is None else torch.device(device)
    pm = init_process_mesh((r.dp, r.pp, r.tp))
    h = FrontierGPT(make_model(r).to(device), pm, r)
    manager = CheckpointManager(directory, keep_last=2)
    start, losses = 0, []
    if agreed_latest(manager) is not None:
        start, extra = h.load(manager)
        losses = list(extra["losses"])
    out = {"resumed_from": start, "seconds": [], "grad_norms": [],
           "n_params": sum(p.numel() for p in h.parameters())}
    batches = make_batches(r)
    for i in range(start, r.steps):
        if plan is not None:
            plan.maybe_fail(attempt, rank, i)
        x, y = (t.to(device) for t in batches[i])
        dist.barrier()
        t0 = time.perf_counter()
        if i == measure_step:
            with trace.Recorder() as rec, CommMeter(h.comm_groups()) as meter, track_memory() as mem:
                loss = h.train_step(x, y)
            out.update(events=rec.events, bytes=dict(meter.sent), peak_bytes=mem.peak_bytes)
        else:
            loss = h.train_step(x, y)
        out["seconds"].append(time.perf_counter() - t0)
        if h.last_grad_norm is not None:
            out["grad_norms"].append(h.last_grad_norm)
        losses.append(_mean_loss(loss, h))
        if (i + 1) % r.checkpoint_every == 0 or i + 1 == r.steps:
            h.save(manager, i + 1, {"losses": losses})
    out.update(losses=losses, state_bytes=h.zero.state_bytes(), coords=pm.coords, stage=h.stage)
    h.zero.close()
    return out


def train_reference(recipe: dict | Recipe, *, with_norms: bool = False):
    """The same training in one process, no parallelism: the same model (MoE included), the same
    precision policy (bf16 model, fp32 master weights and Adam via
    :class:`course_lib.precision.MasterWeightOptimizer`, the loss in fp32), the full batch per step,
    the gradients clipped by their global norm (computed in fp32). Returns the losses, and with
    ``with_norms`` also the norms before clipping: ``(losses, norms)``."""
    from course_lib.precision import MasterWeightOptimizer
    r = recipe if isinstance(recipe, Recipe) else Recipe(**recipe)
    model = make_model(r).to(r.dtype)
    opt = MasterWeightOptimizer(model.parameters(), lambda ps: torch.optim.Adam(ps, lr=r.lr, foreach=False))
    losses, norms = [], []
    for x, y in make_batches(r):
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        if r.clip is not None:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norm = torch.stack([g.float().square().sum() for g in grads]).sum().sqrt()
            coef = min(1.0, r.clip / (float(norm) + 1e-6))
            for g in grads:
                g.mul_(coef)
            norms.append(float(norm))
        opt.step()
        losses.append(float(loss.detach()))
    return (losses, norms) if with_norms else losses


def step_flops(recipe: dict | Recipe) -> int:
    """FLOPs of one training step (forward + backward of the global batch, the MoE's active experts
    only), counted by ``torch.utils.flop_counter`` on the one-process model (``course_lib.estimate.count_flops``);
    recomputation's extra forward is not included (that is MFU's convention; HFU would count it)."""
    from course_lib.estimate import count_flops
    r = recipe if isinstance(recipe, Recipe) else Recipe(**recipe)
    model = make_model(r)
    x, y = make_batches(r)[0]

    def step():
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    _, total, _ = count_flops(step)
    return int(total)
