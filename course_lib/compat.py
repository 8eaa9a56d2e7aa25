"""The one place where the course meets differences between the versions it supports.

The course runs on Google Colab's stock image without upgrading anything (CONTRIBUTING.md, "Supported
versions": torch >= 2.11, jax >= 0.7.2, ipywidgets >= 7.7) and on the newest releases. Where an API
was renamed or added between those versions, the course calls the function of the same name here,
which uses the current API when this install has it and its older equivalent otherwise. The prose of
the notebooks teaches the current names; this module says which older name stands in for each.

=============================  ===================================  ===================================
here                           current API                          older equivalent (used when absent)
=============================  ===================================  ===================================
:func:`all_gather_single`      ``dist.all_gather_single``           ``dist.all_gather_into_tensor``
                               (torch >= 2.13)                      (torch <= 2.12)
:func:`reduce_scatter_single`  ``dist.reduce_scatter_single``       ``dist.reduce_scatter_tensor``
                               (torch >= 2.13)                      (torch <= 2.12)
:func:`all_to_all`             ``dist.all_to_all`` (a list per      one ``dist.all_to_all_single`` on
                               rank; gloo has it from torch 2.12)   the concatenated blocks (gloo on
                                                                    torch 2.11: "does not support
                                                                    alltoall")
:func:`shard_map`              ``jax.shard_map`` (jax >= 0.6)        ``jax.experimental.shard_map``
:func:`pcast`                  ``jax.lax.pcast(x, axis,             ``jax.lax.pvary(x, axis)``
                               to="varying")`` (jax >= 0.8.2)       (jax 0.7)
:func:`widget_mimebundle`      ``widget._repr_mimebundle_()``       the same bundle built by hand
                               (ipywidgets 8)                       (ipywidgets 7 displays through
                                                                    ``_ipython_display_``)
=============================  ===================================  ===================================

Nothing here changes torch, jax or ipywidgets: each function only chooses which of their APIs to call.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from course_lib.colab import version_tuple

__all__ = ["version_tuple", "TORCH_VERSION", "all_gather_single", "reduce_scatter_single",
           "all_to_all", "pcast", "shard_map", "widget_mimebundle"]


TORCH_VERSION = version_tuple(torch.__version__)


# --------------------------------------------------------------------------------- torch.distributed

def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """``dist.all_gather_single(output, input, group)``: every rank's ``input`` concatenated into
    ``output`` (``world_size * input.numel()`` elements), rank order. torch <= 2.12 calls it
    ``all_gather_into_tensor``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """``dist.reduce_scatter_single(output, input, op, group)``: ``input`` reduced over the ranks, rank r
    keeps block r (``output.numel()`` elements). torch <= 2.12 calls it ``reduce_scatter_tensor``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def _list_all_to_all_supported(group) -> bool:
    """gloo's list ``all_to_all`` exists from torch 2.12 (2.11 raises "Backend gloo does not support
    alltoall"); NCCL has had it all along."""
    return TORCH_VERSION >= (2, 12) or dist.get_backend(group) != "gloo"


def all_to_all(output_list: Sequence[torch.Tensor], input_list: Sequence[torch.Tensor], group=None):
    """``dist.all_to_all(output_list, input_list, group)``: rank r's ``input_list[j]`` lands in rank j's
    ``output_list[r]``; blocks may differ in size. Where the backend has no list form (gloo on torch
    2.11), the same exchange is one ``dist.all_to_all_single`` of the flattened blocks laid end to end,
    with their sizes as the splits: the same bytes to the same ranks. Returns ``output_list``."""
    if _list_all_to_all_supported(group):
        dist.all_to_all(list(output_list), list(input_list), group=group)
        return output_list
    if len({t.dtype for t in [*output_list, *input_list]}) > 1:
        raise TypeError("all_to_all: every block must have the same dtype")
    send = torch.cat([t.reshape(-1) for t in input_list])
    recv = torch.empty(sum(t.numel() for t in output_list), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(recv, send, output_split_sizes=[t.numel() for t in output_list],
                           input_split_sizes=[t.numel() for t in input_list], group=group)
    for t, piece in zip(output_list, recv.split([t.numel() for t in output_list])):
        t.view(-1).copy_(piece)
    return output_list


# --------------------------------------------------------------------------------- JAX

def pcast(x, axis_name, to: str = "varying"):
    """``jax.lax.pcast(x, axis_name, to="varying")``: mark ``x`` (the same on every device of
    ``axis_name``) as device-varying inside ``shard_map``, so that its gradient is per device instead
    of already summed over the devices. jax 0.7 spells it ``jax.lax.pvary(x, axis_name)``."""
    import jax

    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axis_name, to=to)
    if to != "varying":
        raise NotImplementedError(f"pcast(..., to={to!r}) needs jax >= 0.8.2; this jax {jax.__version__} "
                                  "only has pvary (to='varying')")
    return jax.lax.pvary(x, axis_name)


def shard_map(f, mesh, in_specs, out_specs):
    """``jax.shard_map(f, mesh=..., in_specs=..., out_specs=...)`` (top level since jax 0.6; before,
    ``jax.experimental.shard_map.shard_map``). ``check_vma`` / ``check_rep`` stay at their default."""
    import jax

    sm = getattr(jax, "shard_map", None)
    if sm is None:  # pragma: no cover - jax < 0.6, older than the course supports
        from jax.experimental.shard_map import shard_map as sm
    return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


# --------------------------------------------------------------------------------- ipywidgets

def widget_mimebundle(widget) -> dict:
    """The display bundle of an ipywidgets widget: ``text/plain`` and the widget view
    (``application/vnd.jupyter.widget-view+json``). ipywidgets 8 returns it from
    ``_repr_mimebundle_``; ipywidgets 7 (Colab's) builds the same dictionary inside
    ``_ipython_display_`` and has no method that returns it, so it is built here the same way."""
    if hasattr(widget, "_repr_mimebundle_"):
        return dict(widget._repr_mimebundle_())
    bundle = {"text/plain": repr(widget)}
    if getattr(widget, "_view_name", None) is not None:
        bundle["application/vnd.jupyter.widget-view+json"] = {
            "version_major": 2, "version_minor": 0, "model_id": widget._model_id}
    return bundle
