"""The tiny GPT on a ``(dp, pp, tp)`` mesh, or ``(dp, pp, cp, tp)``: the model and its training run
(notebooks 09 and 15).

:class:`HybridGPT` is one rank's share of a :class:`course_lib.models.TinyGPT` trained with data
parallelism (notebook 04), tensor parallelism (notebook 07) and pipeline parallelism (notebook 08) at
once, built from those notebooks' modules on a :class:`course_lib.mesh.ProcessMesh`;
:func:`hybrid_param_count` counts its parameters, replicated copies included.

The training run: :func:`train` is one rank of a ``dp x pp x tp`` run of the seeded tiny GPT
(:func:`make_model`, :func:`make_batches`, sizes :data:`DEFAULTS`), :func:`train_reference` the same
training in one process, :func:`replica_losses` the global loss curve from every rank's result. It runs
on the virtual cluster (notebook 09)::

    from course_lib.launch import Cluster
    from course_lib.hybrid_gpt import train
    with Cluster(8) as c:
        out = c.run(train, 2, 2, 2)          # dp, pp, tp

and under ``torchrun`` through the entry point :mod:`course_lib.demos.hybrid`. ``train(..., cp=2)``
adds context parallelism (notebook 15): each sequence split over ``cp`` ranks in the zig-zag layout,
attention run as :func:`course_lib.context_parallel.ring_attention` over the ``cp`` group. This module is the twin
of :mod:`course_lib.frontier` (notebook 14's model and run, a subclass of :class:`HybridGPT`).
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib import collectives
from course_lib import context_parallel as cpar
from course_lib.mesh import AXES, CP_AXES, MeshError, ProcessMesh, init_process_mesh

__all__ = ["HybridGPT", "hybrid_param_count", "DEFAULTS", "make_model", "make_batches", "train_reference",
           "train", "replica_losses"]


# --------------------------------------------------------------------------- the model
class _Embed(nn.Module):
    """Stage 0's first layer: vocabulary-parallel token embedding + replicated position embedding.
    With context parallelism (``cp > 1``) ``idx`` is this rank's share of each sequence, in the
    zig-zag layout, and each token gets the embedding of its position in the full sequence."""

    def __init__(self, wte: nn.Module, wpe: nn.Embedding, cp: int = 1, cp_rank: int = 0):
        super().__init__()
        self.wte, self.wpe, self.cp, self.cp_rank = wte, wpe, cp, cp_rank

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.cp == 1:
            pos = torch.arange(idx.shape[1], device=idx.device)
        else:                                          # my chunks' positions in the full sequence
            pos = cpar.sequence_positions(idx.shape[1] * self.cp, self.cp, self.cp_rank, "zigzag").to(idx.device)
        return self.wte(idx) + self.wpe(pos)          # (B, T/cp, h), the same on every tp rank


class _RingSelfAttention(nn.Module):
    """A tensor-parallel attention (:class:`course_lib.tensor_parallel.ParallelSelfAttention`: the same
    ``qkv`` and ``proj`` shards) whose attention core is causal ring attention over the ``cp`` group
    (:func:`course_lib.context_parallel.ring_attention`, zig-zag layout): the rank holds ``T/cp``
    tokens of each sequence, their queries stay, the K/V blocks of the other ``cp - 1`` ranks pass by."""

    def __init__(self, attn: nn.Module, cp_group):
        super().__init__()
        self.qkv, self.proj, self.local_heads, self.cp_group = attn.qkv, attn.proj, attn.local_heads, cp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)                                   # (B, T/cp, 3 C/t): [q | k | v] of my heads
        B, n, _ = qkv.shape
        c = qkv.shape[-1] // 3
        # (B, T/cp, C/t) -> (B, local_heads, T/cp, head_dim)
        q, k, v = (u.view(B, n, self.local_heads, c // self.local_heads).transpose(1, 2) for u in qkv.split(c, dim=2))
        y = cpar.ring_attention(q, k, v, self.cp_group, causal=True, layout="zigzag")
        return self.proj(y.transpose(1, 2).contiguous().view(B, n, c))


class _Head(nn.Module):
    """The last stage's final layer norm and LM head, tied to the token embedding: ``x W_r^T`` gives
    this rank's vocabulary slice of the logits ``(B, T, V/t)`` (the loss is vocabulary parallel)."""

    def __init__(self, ln_f: nn.LayerNorm, weight: nn.Parameter, group, builtin: bool):
        super().__init__()
        from course_lib.tensor_parallel import copy_to_tensor_parallel
        self._f = copy_to_tensor_parallel
        self.ln_f, self.weight, self.group, self.builtin = ln_f, weight, group, builtin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._f(self.ln_f(x), self.group, builtin=self.builtin)   # f: all-reduce in the backward
        return F.linear(x, self.weight)                                # (B, T, V/t)


class HybridGPT:
    """One rank's share of a :class:`course_lib.models.TinyGPT` under data x pipeline x tensor
    parallelism, built from the course's own modules:

    * pipeline (notebook 08): the blocks are cut into ``pp`` stages balanced by block count
      (:func:`course_lib.pipeline.balance`); stage 0 also holds the embeddings, the last stage the
      final layer norm and the LM head; one step runs a schedule (``"1f1b"`` by default) with
      :func:`course_lib.pipeline.run_schedule` over the ``pp`` group;
    * tensor (notebook 07): every block becomes a :class:`course_lib.tensor_parallel.ParallelBlock`
      on the ``tp`` group, the token embedding a ``VocabParallelEmbedding`` and the loss
      :func:`~course_lib.tensor_parallel.vocab_parallel_cross_entropy`;
    * data (notebook 04): after the pipeline's backward every gradient is averaged over the ``dp``
      group with one ring all-reduce of all of them flattened (:func:`course_lib.collectives.ring_all_reduce`,
      one bucket);
    * context (notebook 15; only on a mesh with a ``cp`` axis, :data:`course_lib.mesh.CP_AXES`): each
      sequence of the rank's micro-batches is split over the ``cp`` group in the zig-zag layout
      (:func:`course_lib.context_parallel.shard_sequence`), the embedding uses the tokens' positions
      in the full sequence and every attention is causal ring attention over the ``cp`` group. Each
      ``cp`` rank's loss is the mean over its tokens, so the gradients are averaged over the ``dp x cp``
      ranks of a (stage, tp) slice (one all-reduce over a ``dp_cp`` group), as Megatron-LM does;
    * with ``overlap_dp=True`` (notebook 16) the data-parallel average is not one all-reduce after the
      pipeline but one per block of the stage (the embedding's and the head's parameters join the
      first and the last block's), launched (torch's ``all_reduce(async_op=True)``, as
      notebook 04's :class:`~course_lib.data_parallel.BucketedDDP`) as soon as that layer's gradient
      is final, i.e. during the last micro-batch's backward, while the earlier layers still compute.

    The LM head is tied to the token embedding (as GPT-2). With ``pp > 1`` they live on different
    ranks, so the last stage keeps a copy and the two copies' gradients are summed over a group of
    {first stage, last stage} ranks (Megatron-LM's "embedding group") before the data-parallel average;
    both copies then take the same optimizer step.

    Args:
        model: the full model (every rank passes the same one, e.g. built from the same seed); its
            weights are copied into the shards, ``model`` itself is not changed.
        pmesh: this rank's :class:`ProcessMesh` with axes ``dp``, ``pp`` and ``tp`` (or ``dp``, ``pp``,
            ``cp``, ``tp``).
        schedule: a name of :data:`course_lib.pipeline.SCHEDULES` without virtual stages
            (``"1f1b"``, ``"gpipe"``, ``"zb-h1"``).
        builtin: torch's collectives for tensor and data parallelism instead of the course's rings.
        overlap_dp: overlap the data-parallel gradient all-reduce with the backward (above); the
            result equals the default path's to rounding. The tied embedding's copies are summed and
            averaged after the pipeline either way.

    ``tp`` must divide the heads and the vocabulary, ``pp`` must not exceed the number of blocks,
    ``2 cp`` must divide the sequence length (the zig-zag layout's chunks).
    """

    def __init__(self, model: nn.Module, pmesh: ProcessMesh, *, schedule: str = "1f1b", builtin: bool = False,
                 overlap_dp: bool = False):
        from course_lib import pipeline

        if not isinstance(overlap_dp, bool):
            raise TypeError(f"overlap_dp must be True or False, got {overlap_dp!r}")
        if set(pmesh.mesh.names) not in (set(AXES), set(CP_AXES)):
            raise MeshError(f"HybridGPT needs a mesh with axes {AXES} or {CP_AXES}, got {pmesh.mesh.names}")
        if schedule not in pipeline.SCHEDULES or schedule in ("interleaved", "naive"):
            raise ValueError(f"schedule must be one of 'gpipe', '1f1b', 'zb-h1' (one stage per rank), got {schedule!r}")
        dp, pp, tp = (pmesh.size(a) for a in AXES)
        L, heads = len(model.blocks), model.blocks[0].attn.n_head
        vocab = model.wte.num_embeddings
        if heads % tp or vocab % tp:
            raise MeshError(f"tp={tp} must divide the number of heads ({heads}) and the vocabulary ({vocab}); "
                            f"choose tp among {[d for d in range(1, heads + 1) if heads % d == 0 and vocab % d == 0]}")
        if pp > L:
            raise MeshError(f"pp={pp} stages but the model has {L} blocks: every stage needs at least one; "
                            f"use pp <= {L} or a deeper model")
        self.pmesh, self.schedule_name, self.builtin = pmesh, schedule, builtin
        self.dp, self.pp, self.tp = dp, pp, tp
        self.cp = pmesh.size("cp") if "cp" in pmesh.mesh.names else 1
        self.stage = pmesh.local_rank("pp")
        self.bounds = pipeline.balance([1.0] * L, pp)
        self.module = self._build(model)
        self.first, self.last = self.stage == 0, self.stage == pp - 1
        # the embedding group: the first and the last stage of my (dp, cp, tp) pipeline (all ranks create all)
        mesh = pmesh.mesh
        self.tied_group = None
        if pp > 1:
            for r in range(mesh.size):
                c = mesh.coords(r)
                if c["pp"] == 0:
                    ranks = [r, mesh.rank_of(**{**c, "pp": pp - 1})]
                    g = dist.new_group(ranks)
                    if pmesh.rank in ranks:
                        self.tied_group = g
        # the gradients' group: the dp group, or with context parallelism every (dp, cp) rank of my slice
        self.grad_group = pmesh.group("dp")
        if self.cp > 1:
            for r in range(mesh.size):
                c = mesh.coords(r)
                if c["dp"] == 0 and c["cp"] == 0:
                    ranks = [mesh.rank_of(**{**c, "dp": d, "cp": k}) for d in range(dp) for k in range(self.cp)]
                    g = dist.new_group(ranks)
                    if pmesh.rank in ranks:
                        self.grad_group = g
        self.overlap_dp = overlap_dp
        self._buckets: list[list[nn.Parameter]] = []
        if overlap_dp:                                  # one bucket per block, last block first
            # the embedding's parameters join the first block's bucket, the head's the last one's; a
            # parameter shared by two layers (the tied embedding with one stage) is final only after
            # the backward of the earlier one, so it goes in that layer's bucket
            seen = {id(p) for p in self._tied()}        # reduced after the pipeline (embedding group)
            n_blocks = len(self.bounds[self.stage])
            first_block = 1 if self.stage == 0 else 0
            per_block: list[list[nn.Parameter]] = [[] for _ in range(n_blocks)]
            for j, layer in enumerate(self.module):
                ps = [p for p in layer.parameters() if id(p) not in seen]
                seen.update(id(p) for p in ps)
                per_block[min(max(j - first_block, 0), n_blocks - 1)].extend(ps)
            self._buckets = [ps for ps in reversed(per_block) if ps]
            for ps in self._buckets:
                for p in ps:
                    p.register_post_accumulate_grad_hook(self._grad_ready)
        self._armed = False

    def _build(self, model: nn.Module) -> nn.Sequential:
        """This rank's stage of ``model``, sharded for tensor parallelism (weights copied)."""
        from course_lib.tensor_parallel import VocabParallelEmbedding

        tp_group = self.pmesh.group("tp")
        layers: list[nn.Module] = []
        wte = VocabParallelEmbedding.from_embedding(model.wte, tp_group, builtin=self.builtin)
        if self.stage == 0:
            cp_rank = self.pmesh.local_rank("cp") if self.cp > 1 else 0
            layers.append(_Embed(wte, copy.deepcopy(model.wpe), self.cp, cp_rank))
        for i in self.bounds[self.stage]:
            block = self._shard_block(model.blocks[i], tp_group)
            if self.cp > 1:
                block.attn = _RingSelfAttention(block.attn, self.pmesh.group("cp"))
            layers.append(block)
        if self.stage == self.pp - 1:
            # one stage: the head shares the embedding's Parameter (tied); else a copy, kept in sync
            weight = wte.weight if self.stage == 0 else nn.Parameter(wte.weight.detach().clone())
            layers.append(_Head(copy.deepcopy(model.ln_f), weight, tp_group, self.builtin))
        return nn.Sequential(*layers)

    def _shard_block(self, block: nn.Module, tp_group) -> nn.Module:
        """One block of this stage, tensor parallel (subclasses add recomputation or MoE blocks)."""
        from course_lib.tensor_parallel import ParallelBlock
        return ParallelBlock.from_block(block, tp_group, builtin=self.builtin)

    def comm_groups(self) -> dict:
        """``{"dp", "pp", "tp", "tied"}`` (and ``"cp"``, ``"dp_cp"`` with context parallelism) -> this
        rank's process groups (for :class:`CommMeter`)."""
        out = {**self.pmesh.groups, "tied": self.tied_group}
        if self.cp > 1:
            out["dp_cp"] = self.grad_group
        return out

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (shards and replicated ones), each once."""
        return list(self.module.parameters())

    def local_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        """The tensors of ``model`` that this rank's :meth:`parameters` hold, in the same order and
        shape: shard a model whose weights are, e.g., the full model's gradients to get the slice
        each local gradient must equal."""
        return [p.detach() for p in self._build(model).parameters()]

    def _tied(self) -> list[nn.Parameter]:
        if self.pp == 1 or not (self.first or self.last):
            return []                  # one stage: one shared Parameter; a middle stage: neither copy
        return [self.module[0].wte.weight] if self.first else [self.module[-1].weight]

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def loss_fn(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        from course_lib.tensor_parallel import vocab_parallel_cross_entropy
        return vocab_parallel_cross_entropy(logits, target, self.pmesh.group("tp"), builtin=self.builtin)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, n_micro: int, sync_dp: bool = True) -> float | None:
        """Gradients of the mean loss over the global batch ``(x, y)`` (every rank passes all of it):
        this rank's data-parallel shard (with ``cp > 1``: its zig-zag share of each of those sequences)
        is cut into ``n_micro`` micro-batches and pipelined, then the tied embedding and (with
        ``sync_dp``) the data-parallel replicas are synchronised; pass ``sync_dp=False`` when an
        optimizer such as ZeRO reduces the gradients itself. Returns this replica's mean loss (over
        this rank's tokens) on last-stage ranks, ``None`` elsewhere. Gradients accumulate: call
        :meth:`zero_grad`."""
        from course_lib import pipeline
        from course_lib.data_parallel import shard_range

        n = x.shape[0]
        if n % self.dp:
            raise ValueError(f"the global batch of {n} sequences does not split into dp={self.dp} equal "
                             f"shards; use a multiple of {self.dp}")
        mine = shard_range(n, self.pmesh.local_rank("dp"), self.dp)
        x, y = x[mine], y[mine]
        if self.cp > 1:                                 # my zig-zag share of every sequence
            c = self.pmesh.local_rank("cp")
            x, y = (cpar.shard_sequence(t, self.cp, c, layout="zigzag", dim=1) for t in (x, y))
        xs = pipeline.split_microbatches(x, n_micro) if self.first else None
        ys = pipeline.split_microbatches(y, n_micro) if self.last else None
        sched = pipeline.make_schedule(self.schedule_name, self.pp, n_micro)
        overlap = self.overlap_dp and sync_dp and self.dp * self.cp > 1
        if overlap:                                     # arm the per-layer buckets (see _grad_ready)
            self._armed, self._n_micro, self._count, self._works, self._buckets_sent = True, n_micro, {}, [], []
        try:
            out = pipeline.run_schedule(sched, {self.stage: self.module}, xs, ys,
                                        self.loss_fn if self.last else None, self.pmesh.group("pp"))
        finally:
            self._armed = False
        for p in self._tied():                          # embedding group: sum the two copies' gradients
            g = getattr(p, "main_grad", None)           # ZeRO(reduce_dtype=...)'s fp32 gradient, if any
            self._all_reduce(p.grad if g is None else g, self.tied_group)
        if overlap:                                     # launch what the backward did not, wait for all
            while len(self._works) < len(self._buckets):
                self._launch(len(self._works))
            for (params, flat), work in zip(self._buckets_sent, self._works):
                work.wait()
                self._unflatten(params, flat / (self.dp * self.cp))
            rest = self._tied()
        elif self.dp * self.cp > 1 and sync_dp:
            rest = self.parameters()
        else:
            rest = []
        params = [p for p in rest if p.grad is not None]
        if params:                                      # data (x context) parallel: one flat bucket, then average
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            self._all_reduce(flat, self.grad_group)
            self._unflatten(params, flat / (self.dp * self.cp))
        return out["loss"]

    @staticmethod
    def _unflatten(params: list[nn.Parameter], flat: torch.Tensor) -> None:
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def _grad_ready(self, p: nn.Parameter) -> None:
        """A gradient hook (``overlap_dp``): after a parameter's last micro-batch, launch every bucket
        whose gradients are all final, in bucket order (every rank of the group must issue its
        all-reduces in the same order)."""
        if not self._armed:
            return
        self._count[id(p)] = self._count.get(id(p), 0) + 1
        while len(self._works) < len(self._buckets) and all(
                self._count.get(id(q), 0) >= self._n_micro for q in self._buckets[len(self._works)]):
            self._launch(len(self._works))

    @torch.no_grad()
    def _launch(self, i: int) -> None:
        params = self._buckets[i]
        for p in params:                                # a layer this rank gave no gradient: zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self._buckets_sent.append((params, flat))
        self._works.append(dist.all_reduce(flat, group=self.grad_group, async_op=True))

    def _all_reduce(self, t: torch.Tensor, group) -> None:
        collectives.all_reduce(t, group=group, builtin=self.builtin)

    def __repr__(self) -> str:
        c = self.pmesh.coords
        cp = f", cp={c['cp']}/{self.cp}" if self.cp > 1 else ""
        return (f"HybridGPT(rank {self.pmesh.rank}: dp={c['dp']}/{self.dp}, stage {self.stage}/{self.pp} "
                f"blocks {list(self.bounds[self.stage])}{cp}, tp={c['tp']}/{self.tp})")


def hybrid_param_count(n_layer: int, hidden: int, vocab: int, block_size: int, tp: int, pp: int) -> dict:
    """Parameters of :class:`HybridGPT` (a TinyGPT: 4x MLP, biases, tied head) summed over the ranks
    of one data-parallel replica (``tp * pp`` ranks), counting every replicated copy: tensor
    parallelism splits the matrices and the QKV / MLP-input biases but replicates the layer norms,
    the output-projection biases and the position embedding on all ``t`` ranks, and ``pp > 1`` keeps
    a second copy of the tied embedding on the last stage.

    Returns ``{"sharded", "replicated", "tied_copy", "total"}``; ``total`` over a replica is what a
    data-parallel all-reduce of all gradients carries."""
    h, t = hidden, tp
    sharded = n_layer * (3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h) + vocab * h
    replicated_once = n_layer * (2 * h + 2 * h + h + h) + block_size * h + 2 * h
    tied = vocab * h if pp > 1 else 0
    return {"sharded": sharded, "replicated": t * replicated_once, "tied_copy": tied,
            "total": sharded + t * replicated_once + tied}


# --------------------------------------------------------------------------- the training run
#: The tiny GPT and its run: tiny on purpose (2 cores run 8 ranks); every keyword of :func:`train` and
#: :func:`train_reference` overrides one of them.
DEFAULTS = dict(vocab=64, block=16, layers=2, heads=2, hidden=32, batch=16, micro=4, steps=10, lr=3e-3,
                seed=0)


def make_model(vocab=64, block=16, layers=2, heads=2, hidden=32, seed=0, dtype=torch.float64):
    """The seeded TinyGPT every rank builds (the same weights everywhere)."""
    from course_lib.models import TinyGPT
    torch.manual_seed(seed)
    return TinyGPT(vocab_size=vocab, block_size=block, n_layer=layers, n_head=heads, n_embd=hidden).to(dtype)


def make_batches(steps, batch=16, block=16, vocab=64, seed=0):
    """``steps`` seeded ``(x, y)`` token batches of ``batch`` sequences (the same on every rank)."""
    from course_lib.models import make_tokens
    return [make_tokens(batch, block, vocab, seed=seed + 1 + i) for i in range(steps)]


def train_reference(steps=10, dtype=torch.float64, **cfg) -> list[float]:
    """The same training in one process: the losses the hybrid run must reproduce."""
    c = {**DEFAULTS, **cfg}
    model = make_model(c["vocab"], c["block"], c["layers"], c["heads"], c["hidden"], c["seed"], dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=c["lr"])
    losses = []
    for x, y in make_batches(steps, c["batch"], c["block"], c["vocab"], c["seed"]):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def train(rank: int, world_size: int, dp: int, pp: int, tp: int, steps: int = 10, *,
          dtype=torch.float64, schedule: str = "1f1b", cp: int = 1, overlap_dp: bool = False, **cfg) -> dict:
    """One rank of a ``dp x pp x tp`` training run of the tiny GPT (AdamW, ``steps`` steps); with
    ``cp > 1`` a ``dp x pp x cp x tp`` run (mesh :data:`course_lib.mesh.CP_AXES`; ring attention over
    the ``cp`` group, notebook 15). ``overlap_dp=True`` overlaps the gradient all-reduce with the
    backward (:class:`HybridGPT`; notebook 16).

    Returns ``{"coords", "stage", "losses"}`` (the replica's mean loss per step on last-stage ranks,
    else ``None``), ``"seconds"`` per step and ``"n_params"`` (this rank's). To count bytes per axis,
    wrap a step in :class:`course_lib.mesh.CommMeter` (notebook 09 does). The model and the batches
    are on the rank's device (:func:`course_lib.launch.device`)."""
    from course_lib.launch import device

    c = {**DEFAULTS, **cfg}
    dev = device()
    pm = init_process_mesh((dp, pp, tp)) if cp == 1 else init_process_mesh((dp, pp, cp, tp), CP_AXES)
    model = make_model(c["vocab"], c["block"], c["layers"], c["heads"], c["hidden"], c["seed"], dtype).to(dev)
    h = HybridGPT(model, pm, schedule=schedule, overlap_dp=overlap_dp)
    opt = torch.optim.AdamW(h.parameters(), lr=c["lr"])
    losses, seconds = [], []
    for x, y in make_batches(steps, c["batch"], c["block"], c["vocab"], c["seed"]):
        t0 = time.perf_counter()
        h.zero_grad()
        loss = h.forward_backward(x.to(dev), y.to(dev), c["micro"])
        opt.step()
        seconds.append(time.perf_counter() - t0)
        losses.append(loss)
    return {"coords": pm.coords, "stage": h.stage, "losses": losses if h.last else None, "seconds": seconds,
            "n_params": sum(p.numel() for p in h.parameters())}


def replica_losses(results: list[dict]) -> list[float]:
    """The global loss per step from :func:`train`'s per-rank results: the mean over data-parallel
    replicas (and context-parallel ranks, each the mean over its equal share of the tokens) of the
    last stage's loss (every tp rank of a stage reports the same value)."""
    last = [r["losses"] for r in results if r["losses"] is not None and r["coords"]["tp"] == 0]
    return [sum(col) / len(col) for col in zip(*last)]
