"""Activation checkpointing (gradient checkpointing, activation recomputation) from scratch.

Training keeps, for the backward, the activations every op saved in the forward. Checkpointing a
function ``fn`` keeps only its *inputs* and runs ``fn`` a second time in the backward to get the
rest back: memory for compute. Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"
(arXiv:1604.06174), §3-4: cut ``L`` layers into ``k`` segments, keep the ``k`` segment inputs and,
during the backward, the activations of one segment at a time: memory ``~ k + L/k``, smallest at
``k = sqrt(L)``, i.e. ``O(sqrt(L))``, for the price of one extra forward pass.

Three pieces, all with the semantics of ``torch.utils.checkpoint``:

* :func:`checkpoint_reentrant` -- the textbook version, a custom ``autograd.Function`` that runs
  ``fn`` under ``no_grad`` and re-runs it in its ``backward``. Its flaw (the reason PyTorch now
  recommends ``use_reentrant=False``): when no *input* requires grad the Function's output does
  not either, autograd never calls its backward, and the parameters inside ``fn`` get no gradient.
* :func:`checkpoint` -- the version that does not have the flaw: ``fn`` runs normally (grad on,
  the graph is built, parameters are connected), but every tensor an op wants to save goes through
  ``torch.autograd.graph.saved_tensors_hooks``, which store only a ticket. The first time the
  backward asks for a ticket, ``fn`` is re-run once on the kept inputs and the tickets are served
  from that recomputation (as ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``).
* :func:`checkpoint_sequential` -- a stack of layers cut into segments (Chen et al.'s schedule).

Both recomputing versions restore the RNG state of the forward before re-running ``fn`` (so dropout
draws the same masks) inside ``torch.random.fork_rng`` (so the global RNG ends where an
un-checkpointed run leaves it), and both replay the forward's autocast state (the standard AMP pattern
runs the forward under ``torch.autocast`` and the backward outside it; the recomputation must still
compute in bf16/fp16, as ``torch.utils.checkpoint`` records the autocast state for). Selective recomputation (Korthikanti et al. 2022, §5) checkpoints only the attention
core: :func:`course_lib.models.causal_attention` in :class:`TransformerBlock` with ``recompute="selective"``.
Checkpointing is per device: nothing here communicates.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.models import causal_attention

__all__ = ["checkpoint", "checkpoint_reentrant", "checkpoint_sequential", "segment_bounds",
           "TransformerBlock", "RECOMPUTE"]

RECOMPUTE = ("none", "selective", "full")


# --------------------------------------------------------------------------- RNG

def _rng_devices(tensors) -> list:
    """CUDA devices of ``tensors`` (their generators must be replayed too)."""
    return sorted({t.device.index or 0 for t in tensors
                   if isinstance(t, torch.Tensor) and t.device.type == "cuda"})


def _get_rng(devices) -> tuple:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


def _set_rng(state, devices) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for d, s in zip(devices, cuda):
        torch.cuda.set_rng_state(s, d)


# --------------------------------------------------------------------------- autocast

def _get_autocast(args) -> list:
    """The autocast state of the CPU and of the devices of ``args``: ``[(device type, enabled, dtype,
    cache enabled)]``, to replay around the recomputation (:func:`_autocast`)."""
    types = ["cpu"] + sorted({a.device.type for a in args if isinstance(a, torch.Tensor)} - {"cpu"})
    cache = torch.is_autocast_cache_enabled()
    return [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t), cache) for t in types]


def _autocast(state) -> contextlib.ExitStack:
    """Enter the autocast state :func:`_get_autocast` captured (enabled or not, per device type)."""
    stack = contextlib.ExitStack()
    for device_type, enabled, dtype, cache in state:
        stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
    return stack


def _check_fn(fn, name: str = "checkpoint") -> None:
    if not callable(fn):
        raise TypeError(f"{name}(fn, *args): fn must be callable (a module or a function), got "
                        f"{type(fn).__name__}; pass the function first, then its inputs")


# --------------------------------------------------------------------------- reentrant (flawed)

class _ReentrantCheckpoint(torch.autograd.Function):
    """Forward under ``no_grad``; backward re-runs ``fn`` with grad on and backpropagates through it."""

    @staticmethod
    def forward(ctx, fn, preserve_rng_state, *args):
        ctx.fn, ctx.preserve = fn, preserve_rng_state
        ctx.devices = _rng_devices(args)
        ctx.autocast = _get_autocast(args)
        if preserve_rng_state:
            ctx.rng = _get_rng(ctx.devices)
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in args]
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        ctx.save_for_backward(*[a for a in args if isinstance(a, torch.Tensor)])
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, *grads):
        tensors = iter(ctx.saved_tensors)
        args = [next(tensors) if t else o for t, o in zip(ctx.is_tensor, ctx.others)]
        args = [a.detach().requires_grad_(a.requires_grad) if t else a
                for a, t in zip(args, ctx.is_tensor)]
        with torch.random.fork_rng(devices=ctx.devices, enabled=ctx.preserve):
            if ctx.preserve:
                _set_rng(ctx.rng, ctx.devices)
            with torch.enable_grad(), _autocast(ctx.autocast):
                out = ctx.fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[a.grad if isinstance(a, torch.Tensor) else None for a in args])


def checkpoint_reentrant(fn, *args, preserve_rng_state: bool = True):
    """``fn(*args)`` with recomputation, as a plain (reentrant) ``autograd.Function``.

    Equal to ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)``: the forward
    keeps only the tensor ``args``; the backward re-runs ``fn`` (RNG replayed) and calls
    ``torch.autograd.backward`` inside the outer backward (hence "reentrant"). ``fn`` must return a
    tensor or a tuple of tensors. **Limitation, kept on purpose for teaching:** if no tensor in
    ``args`` requires grad, the output does not require grad, the backward is never called and the
    parameters inside ``fn`` receive no gradient (PyTorch warns; we raise nothing and show it).
    """
    _check_fn(fn, "checkpoint_reentrant")
    return _ReentrantCheckpoint.apply(fn, preserve_rng_state, *args)


# --------------------------------------------------------------------------- non-reentrant

class _SaveInputs(torch.autograd.Function):
    """Saves the checkpoint's tensor inputs through autograd (like every op saves what it needs),
    so they are counted by saved-tensor accounting and version-checked when taken back. Its output
    is an empty dummy that nothing uses, but the frame must hold that *output*, not only its
    ``grad_fn``: torch 2.11 frees the saved tensors of a node whose outputs are all gone
    (``torch.utils.checkpoint`` keeps its ``input_saver`` output alive for the same reason)."""

    @staticmethod
    def forward(ctx, dummy, *tensors):
        ctx.save_for_backward(*tensors)
        return dummy.new_empty(0)

    @staticmethod
    def backward(ctx, _grad):  # pragma: no cover - the dummy output is never used
        return (None,) * (1 + len(ctx.saved_tensors))


class _Frame:
    """One checkpointed call: the saved inputs, the RNG state, and the recomputed saved tensors."""

    def __init__(self, fn, args, kwargs, preserve_rng_state):
        self.fn, self.kwargs, self.preserve = fn, kwargs, preserve_rng_state
        self.is_tensor = [isinstance(a, torch.Tensor) for a in args]
        self.others = [None if t else a for a, t in zip(args, self.is_tensor)]
        self.flags = [a.requires_grad if t else False for a, t in zip(args, self.is_tensor)]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        # an empty placeholder (no data) on the inputs' device, so the saver's node has one device
        dummy = torch.empty(0, device=tensors[0].device if tensors else "cpu", requires_grad=True)
        self.saver = _SaveInputs.apply(dummy, *tensors)
        self.devices = _rng_devices(args)
        self.rng = _get_rng(self.devices) if preserve_rng_state else None
        self.autocast = _get_autocast(args)
        self.n_saved = 0        # tickets handed out in the forward
        self.store = {}         # ticket -> recomputed tensor, until the backward takes it

    def recompute(self) -> None:
        try:
            tensors = iter(self.saver.grad_fn.saved_tensors)
        except RuntimeError as e:
            raise RuntimeError("checkpoint: an input of fn was modified in place after the forward, "
                               "so the recomputation would see different values; clone the input "
                               f"before changing it (autograd said: {e})") from None
        args = [next(tensors).detach().requires_grad_(f) if t else o
                for t, o, f in zip(self.is_tensor, self.others, self.flags)]
        stored = []

        def pack(t):
            stored.append(t.detach())   # the recomputed graph is thrown away: keep values only

        with torch.random.fork_rng(devices=self.devices, enabled=self.preserve):
            if self.preserve:
                _set_rng(self.rng, self.devices)
            with torch.enable_grad(), _autocast(self.autocast), \
                    torch.autograd.graph.saved_tensors_hooks(pack, _no_unpack):
                self.fn(*args, **self.kwargs)
        if len(stored) != self.n_saved:
            raise RuntimeError(f"checkpoint: re-running fn saved {len(stored)} tensors but the "
                               f"forward saved {self.n_saved}; fn must do the same operations each "
                               f"time it runs (no data-dependent branches on random or mutable state)")
        self.store = dict(enumerate(stored))


def _no_unpack(_):
    raise RuntimeError("checkpoint: the recomputed graph is not meant to be backpropagated")


def checkpoint(fn, *args, preserve_rng_state: bool = True, **kwargs):
    """``fn(*args, **kwargs)`` keeping only its inputs; ``fn`` is re-run in the backward.

    Same semantics as ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)``:

    * the forward builds the normal graph (so the parameters inside ``fn`` get gradients even when
      no input requires grad), but the tensors its ops save are replaced by tickets
      (``saved_tensors_hooks``); only the inputs are kept;
    * the first ticket the backward unpacks re-runs ``fn`` once (grad on, the forward's RNG state
      restored, so dropout masks are identical) and serves every ticket from that run; each tensor
      is dropped as soon as the backward has taken it;
    * the global RNG is left where the un-checkpointed run leaves it (``fork_rng``);
    * the recomputation runs under the forward's autocast state, whatever the state at the backward.

    Any output structure is allowed. Raises ``TypeError`` if ``fn`` is not callable and
    ``RuntimeError`` if an input was modified in place before the backward or if ``fn`` saved a
    different number of tensors when re-run. Memory: the inputs plus, during the backward, one
    recomputation of ``fn``'s saved tensors (Chen et al. 2016, §3).
    """
    _check_fn(fn)
    frame = _Frame(fn, args, kwargs, preserve_rng_state)

    def pack(_t):
        ticket = frame.n_saved
        frame.n_saved += 1
        return frame, ticket            # the frame (and so the inputs) lives as long as a ticket

    def unpack(handle):
        frame_, ticket = handle
        if ticket not in frame_.store:  # first use, or a second backward (retain_graph=True)
            frame_.recompute()
        return frame_.store.pop(ticket)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fn(*args, **kwargs)


# --------------------------------------------------------------------------- sequential

def segment_bounds(n_layers: int, segments: int) -> list:
    """``[(start, end), ...]`` (end exclusive) of the segments ``torch.utils.checkpoint.checkpoint_sequential``
    uses: ``segments - 1`` segments of ``n_layers // segments`` layers, the last takes the rest."""
    if not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive int, got {n_layers!r}")
    if not isinstance(segments, int) or not 1 <= segments <= n_layers:
        raise ValueError(f"segments={segments!r} must be an int in 1..{n_layers} (the number of "
                         f"layers); for every k-th layer checkpointed use segments = n_layers // k")
    size = n_layers // segments
    bounds = [(s * size, (s + 1) * size) for s in range(segments - 1)]
    return bounds + [((segments - 1) * size, n_layers)]


def checkpoint_sequential(layers, segments: int, x, preserve_rng_state: bool = True):
    """Run ``layers`` (a list or ``nn.Sequential`` of one-input callables) on ``x`` in ``segments``
    segments, checkpointing all but the last (whose activations the backward needs first).

    Same partition and semantics as ``torch.utils.checkpoint.checkpoint_sequential(layers,
    segments, x, use_reentrant=False)`` (see :func:`segment_bounds`). Kept for the backward:
    ``segments - 1`` segment inputs plus the last segment's activations; during the backward, one
    segment's activations at a time (Chen et al. 2016, §4.1: minimal near ``segments = sqrt(L)``).
    """
    layers = list(layers.children()) if isinstance(layers, nn.Sequential) else list(layers)
    bounds = segment_bounds(len(layers), segments)

    def run(start, end):
        def segment(h):
            for layer in layers[start:end]:
                h = layer(h)
            return h
        return segment

    for start, end in bounds[:-1]:
        x = checkpoint(run(start, end), x, preserve_rng_state=preserve_rng_state)
    return run(*bounds[-1])(x)


# --------------------------------------------------------------------------- selective

class TransformerBlock(nn.Module):
    """``course_lib.models.Block`` with dropout (Korthikanti's layer) and a ``recompute`` choice.

    Same parameters and names as ``models.Block`` (``ln1, attn.qkv, attn.proj, ln2, fc, fc_proj``:
    ``load_state_dict`` works both ways); dropout ``p`` on the attention probabilities, after the
    attention projection and after the MLP. ``recompute``: ``"none"``, ``"selective"`` (checkpoint
    the attention core, :func:`course_lib.models.causal_attention`, only: recomputing it removes the
    ``as^2b`` terms at a small FLOP cost) or ``"full"`` (checkpoint the whole block; keeps its input).
    Input and output ``(B, s, h)``.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.1, recompute: str = "none"):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute={recompute!r}: choose one of {RECOMPUTE}")
        self.n_head, self.p, self.recompute = n_head, dropout, recompute
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.attn.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_proj = nn.Linear(4 * n_embd, n_embd)

    def _attention(self, x):
        B, T, C = x.shape
        q, k, v = self.attn.qkv(x).split(C, dim=2)                          # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.recompute == "selective":
            y = checkpoint(causal_attention, q, k, v, self.p, self.training)
        else:
            y = causal_attention(q, k, v, self.p, self.training)            # (B, a, T, d)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                    # (B, T, C)
        return F.dropout(self.attn.proj(y), self.p, self.training)

    def _block(self, x):
        x = x + self._attention(self.ln1(x))
        return x + F.dropout(self.fc_proj(F.gelu(self.fc(self.ln2(x)))), self.p, self.training)

    def forward(self, x):
        if self.recompute == "full":
            return checkpoint(self._block, x)
        return self._block(x)
