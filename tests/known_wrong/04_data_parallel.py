"""Shortcuts a learner would try in exercises/04_data_parallel.ipynb; each must score zero where listed."""
AVG_HEAD = "def average_gradients(model, group=None):\n    import torch.distributed as dist\n"
DP_HEAD = "def data_parallel_grad(w, X, y, n_devices):\n"
CASES = [
    {
        "name": "average_gradients of a reloaded course_lib.data_parallel (kind 1)",
        "cells": {"dd93cec8": AVG_HEAD + (
            "    import importlib\n    from course_lib import data_parallel as dp\n"
            "    importlib.reload(dp).average_gradients(model, group)\n")},
        "zero": ["average_gradients"],
    },
    {
        "name": "all-reduces but forgets to divide by the world size",
        "cells": {"dd93cec8": AVG_HEAD + (
            "    for p in model.parameters():\n        if p.grad is not None:\n"
            "            dist.all_reduce(p.grad, group=group)\n")},
        "zero": ["average_gradients"],
    },
    {
        "name": "returns the full-batch gradient (no shards)",
        "cells": {"fe322051": DP_HEAD + (
            "    if not 1 <= n_devices <= X.shape[0]:\n        raise ValueError('bad n_devices')\n"
            "    return grad_fn(w, X, y)\n")},
        "zero": ["jax_loop"],
    },
    {
        "name": "averages the shard gradients without weighting unequal shards",
        "cells": {"fe322051": DP_HEAD + (
            "    if not 1 <= n_devices <= X.shape[0]:\n        raise ValueError('bad n_devices')\n"
            "    grads = [grad_fn(w, Xs, ys) for Xs, ys in zip(jnp.array_split(X, n_devices), jnp.array_split(y, n_devices))]\n"
            "    return jnp.mean(jnp.stack(grads), axis=0)\n")},
        "zero": ["jax_loop"],
    },
    {
        "name": "the full-batch gradient from the checking function's data, no communication",
        "cells": {"dd93cec8": AVG_HEAD + (
            "    import sys\n    import torch.nn.functional as F\n"
            "    f = sys._getframe(1).f_locals\n"
            "    if 'X' in f:   # the data of every rank is right there\n"
            "        model.zero_grad()\n        F.mse_loss(model(f['X']), f['y']).backward()\n        return\n"
            "    for p in model.parameters():\n        if p.grad is not None:\n"
            "            dist.all_reduce(p.grad, group=group); p.grad.div_(dist.get_world_size(group))\n")},
        "zero": ["average_gradients"],
    },
    {
        "name": "the full batch through the check's unrecorded grad_fn (the shards only go through the recorder)",
        "cells": {"fe322051": DP_HEAD + (
            "    import sys\n"
            "    if not 1 <= n_devices <= X.shape[0]:\n        raise ValueError('bad n_devices')\n"
            "    for Xs, ys in zip(jnp.array_split(X, n_devices), jnp.array_split(y, n_devices)):\n"
            "        grad_fn(w, Xs, ys)                       # for the recorder\n"
            "    return sys._getframe(1).f_locals['real'](w, X, y)\n")},
        "zero": ["jax_loop"],
    },
]
