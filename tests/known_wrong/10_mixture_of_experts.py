"""Shortcuts a learner would try in exercises/10_mixture_of_experts.ipynb; each must score zero where listed."""
LAYER = '''def expert_fn(x, W1, b1, W2, b2):
    """The source's expert: a two-layer FFN with ReLU."""
    h = jnp.maximum(0, x @ W1 + b1)
    return h @ W2 + b2


def moe_layer(x, gate_W, experts_params, top_k=2):
{body}
'''
TOPK = ("    gate_probs = jax.nn.softmax(x @ gate_W, axis=-1)\n"
        "    top_i = jnp.argsort({sign}gate_probs, axis=-1)[:, :top_k]\n"
        "    top_p = jnp.take_along_axis(gate_probs, top_i, axis=-1)\n"
        "{norm}"
        "    outs = jnp.stack([expert_fn(x, *p) for p in experts_params], axis=1)\n"
        "    chosen = jnp.take_along_axis(outs, top_i[:, :, None], axis=1)\n"
        "    return (chosen * top_p[:, :, None]).sum(axis=1), gate_probs")
RENORM = "    top_p = top_p / top_p.sum(axis=-1, keepdims=True)\n"
LB = '''def load_balancing_loss(probs, experts, alpha=0.01):
{body}
'''

CASES = [
    {
        "name": "keeps the top-k probabilities as they are (no renormalisation)",
        "cells": {"ex1-code": LAYER.format(body=TOPK.format(sign="-", norm=""))},
        "zero": ["moe_layer"],
    },
    {
        "name": "sorts ascending: routes every token to its k least likely experts",
        "cells": {"ex1-code": LAYER.format(body=TOPK.format(sign="", norm=RENORM))},
        "zero": ["moe_layer"],
    },
    {
        "name": "dense: the softmax-weighted sum of all experts (no routing)",
        "cells": {"ex1-code": LAYER.format(body=(
            "    gate_probs = jax.nn.softmax(x @ gate_W, axis=-1)\n"
            "    outs = jnp.stack([expert_fn(x, *p) for p in experts_params], axis=1)\n"
            "    return (outs * gate_probs[:, :, None]).sum(axis=1), gate_probs"))},
        "zero": ["moe_layer"],
    },
    {
        "name": "calls the course's course_lib.jax_spmd.moe_layer (switched off during the check)",
        "cells": {"ex1-code": LAYER.format(body=(
            "    from course_lib import jax_spmd\n"
            "    return jax_spmd.moe_layer(x, gate_W, experts_params, top_k)"))},
        "zero": ["moe_layer"],
    },
    {
        "name": "forgets the factor E (uniform routing gives alpha / E)",
        "cells": {"ex2-code": LB.format(body=(
            "    T, E = probs.shape\n"
            "    f = torch.bincount(experts.reshape(-1), minlength=E).to(probs.dtype) / experts.numel()\n"
            "    return alpha * (f * probs.mean(dim=0)).sum()"))},
        "zero": ["load_balancing"],
    },
    {
        "name": "uses the mean probability for f_i too (alpha E sum P_i^2: no counts, wrong value and gradient)",
        "cells": {"ex2-code": LB.format(body=(
            "    T, E = probs.shape\n"
            "    P = probs.mean(dim=0)\n"
            "    return alpha * E * (P * P).sum()"))},
        "zero": ["load_balancing"],
    },
    {
        "name": "calls course_lib.moe.load_balancing_loss (switched off during the check)",
        "cells": {"ex2-code": LB.format(body=(
            "    from course_lib import moe\n"
            "    r = moe.Routing(None, probs, experts, None)\n"
            "    return moe.load_balancing_loss(r, alpha)"))},
        "zero": ["load_balancing"],
    },
]
KEPT = '''def kept(experts, n_experts, capacity):
{body}
'''
CASES += [
    {
        "name": "hands out slots token by token (a token's second choice before the next token's first)",
        "cells": {"ex3-code": KEPT.format(body=(
            "    T, k = experts.shape\n    used = [0] * n_experts\n    out = torch.zeros(T, k, dtype=torch.bool)\n"
            "    for t in range(T):\n        for j in range(k):\n            e = int(experts[t, j])\n"
            "            if used[e] < capacity:\n                used[e] += 1\n                out[t, j] = True\n"
            "    return out"))},
        "zero": ["capacity"],
    },
    {
        "name": "keeps everything (ignores the capacity)",
        "cells": {"ex3-code": KEPT.format(body="    return torch.ones(experts.shape, dtype=torch.bool)")},
        "zero": ["capacity"],
    },
]
CASES += [
    {
        # issue 25, kind 2: the checks called the learner's functions with their references (_reference,
        # _want) in the notebook's globals
        "name": "reads the answers from the check: an expected output in the caller's frames, or its _reference / _want",
        "cells": {
            "ex1-code": LAYER.format(body=(
                "    import sys\n"
                "    f = sys._getframe(1)\n"
                "    while f is not None:\n"
                "        if f.f_locals.get('want') is not None and f.f_locals.get('want_p') is not None:\n"
                "            return jnp.asarray(f.f_locals['want']), jnp.asarray(f.f_locals['want_p'])\n"
                "        f = f.f_back\n"
                "    out, probs = globals()['_reference'](x, gate_W, experts_params, top_k)\n"
                "    return jnp.asarray(out), jnp.asarray(probs)")),
            "ex3-code": KEPT.format(body="    return globals()['_want'](experts, n_experts, capacity)"),
        },
        "zero": ["moe_layer", "capacity"],
    },
    {
        # issue 25, kind 5: the layer was checked forward only
        "name": "stops the gradient at the router (jax.lax.stop_gradient on the probabilities): same forward, no router gradient",
        "cells": {"ex1-code": LAYER.format(body=(
            "    gate_probs = jax.nn.softmax(x @ gate_W, axis=-1)\n"
            "    p = jax.lax.stop_gradient(gate_probs)\n"
            "    top_i = jnp.argsort(-p, axis=-1)[:, :top_k]\n"
            "    top_p = jnp.take_along_axis(p, top_i, axis=-1)\n"
            "    top_p = top_p / top_p.sum(axis=-1, keepdims=True)\n"
            "    outs = jnp.stack([expert_fn(x, *q) for q in experts_params], axis=1)\n"
            "    chosen = jnp.take_along_axis(outs, top_i[:, :, None], axis=1)\n"
            "    return (chosen * top_p[:, :, None]).sum(axis=1), gate_probs"))},
        "zero": ["moe_layer"],
    },
    {
        # issue 25, kind 5: the loss was only ever given the router's own top-k
        "name": "counts the router's own top-k instead of the assignments it is given",
        "cells": {"ex2-code": LB.format(body=(
            "    T, E = probs.shape\n"
            "    mine = probs.topk(experts.shape[-1], dim=-1).indices\n"
            "    f = torch.bincount(mine.reshape(-1), minlength=E).to(probs.dtype) / mine.numel()\n"
            "    return alpha * E * (f * probs.mean(dim=0)).sum()"))},
        "zero": ["load_balancing"],
    },
    {
        # the checks used _guarded from a cell the learner can edit
        "name": "rebinds the check's _guarded to a no-op in its own cell, then calls course_lib.moe",
        "cells": {"ex2-code": "import contextlib\n\n\ndef _guarded():\n    return contextlib.nullcontext()\n\n\n" + LB.format(body=(
            "    from course_lib import moe\n"
            "    return moe.load_balancing_loss(moe.Routing(None, probs, experts, None), alpha)"))},
        "zero": ["load_balancing"],
    },
]

# Exercise 4: auxiliary-loss-free balancing (DeepSeek-V3). Each case replaces the whole ex4-code cell.
EX4 = '''import torch
import torch.distributed as dist


def biased_top_k(probs, bias, top_k):
{choose}


def update_bias(bias, counts, gamma, group=None):
{update}
'''
CHOOSE = ("    experts = (probs + bias.detach()).topk(top_k, dim=-1).indices\n"
          "    chosen = probs.gather(1, experts)\n"
          "    return experts, chosen / chosen.sum(dim=-1, keepdim=True)")
UPDATE = ("    load = counts.detach().to(bias.dtype).clone()\n"
          "    if group is not None:\n"
          "        dist.all_reduce(load, group=group)\n"
          "    with torch.no_grad():\n"
          "        bias.add_(gamma * torch.sign({diff}))\n"
          "    return bias")
GOOD_UPDATE = UPDATE.format(diff="load.mean() - load")
CASES += [
    {
        "name": "puts the bias into the gate weights too (weights from probs + bias, renormalised)",
        "cells": {"ex4-code": EX4.format(choose=(
            "    scores = probs + bias\n"
            "    top = scores.topk(top_k, dim=-1)\n"
            "    return top.indices, top.values / top.values.sum(dim=-1, keepdim=True)"), update=GOOD_UPDATE)},
        "zero": ["bias_routing"],
    },
    {
        "name": "weighs with the biased scores but blocks the bias's gradient (detach): right gradient path, wrong weights",
        "cells": {"ex4-code": EX4.format(choose=(
            "    scores = probs + bias.detach()\n"
            "    top = scores.topk(top_k, dim=-1)\n"
            "    return top.indices, top.values / top.values.sum(dim=-1, keepdim=True)"), update=GOOD_UPDATE)},
        "zero": ["bias_routing"],
    },
    {
        "name": "flips the sign: raises the bias of the overloaded experts",
        "cells": {"ex4-code": EX4.format(choose=CHOOSE, update=UPDATE.format(diff="load - load.mean()"))},
        "zero": ["bias_update"],
    },
    {
        "name": "balances each rank's own micro-batch when the global batch is asked (ignores group)",
        "cells": {"ex4-code": EX4.format(choose=CHOOSE, update=(
            "    load = counts.detach().to(bias.dtype)\n"
            "    with torch.no_grad():\n"
            "        bias.add_(gamma * torch.sign(load.mean() - load))\n"
            "    return bias"))},
        "zero": ["bias_update"],
    },
    {
        "name": "sums the load over the whole world instead of the group",
        "cells": {"ex4-code": EX4.format(choose=CHOOSE, update=UPDATE.format(diff="load.mean() - load").replace(
            "dist.all_reduce(load, group=group)", "dist.all_reduce(load)"))},
        "zero": ["bias_update"],
    },
    {
        "name": "updates the bias by gradient descent on the squared imbalance (a step in proportion to it, not its sign)",
        "cells": {"ex4-code": EX4.format(choose=CHOOSE, update=(
            "    load = counts.detach().to(bias.dtype).clone()\n"
            "    if group is not None:\n"
            "        dist.all_reduce(load, group=group)\n"
            "    with torch.no_grad():\n"
            "        bias.sub_(gamma * (load - load.mean()))   # the gradient of 0.5 |load - mean|^2 through load ~ -bias\n"
            "    return bias"))},
        "zero": ["bias_update"],
    },
    {
        "name": "calls course_lib.moe.route and update_expert_bias (switched off during the checks)",
        "cells": {"ex4-code": EX4.format(
            choose=("    from course_lib import moe\n"
                    "    r = moe.route(torch.log(probs), torch.eye(probs.shape[1], dtype=probs.dtype), top_k, bias=bias)\n"
                    "    return r.experts, r.weights"),
            update=("    from course_lib import moe\n"
                    "    return moe.update_expert_bias(bias, counts, gamma, group)"))},
        "zero": ["bias_routing", "bias_update"],
    },
]
