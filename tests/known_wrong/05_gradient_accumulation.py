"""Shortcuts a learner would try in exercises/05_gradient_accumulation.ipynb; each must score zero where listed."""
HEAD = ("def accumulation_step(model, optimizer, loss_fn, X, y, k):\n"
        "    n = len(X)\n"
        "    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:\n"
        "        raise ValueError(f'bad k {k!r}')\n"
        "    optimizer.zero_grad()\n")
CASES = [
    {
        "name": "one large-batch step that ignores k",
        "cells": {"e4045c5c": HEAD + "    loss = loss_fn(model(X), y)\n    loss.backward()\n    optimizer.step()\n    return loss.item()\n"},
        "zero": ["accumulation_step"],
    },
    {
        "name": "sums the k scaled losses, then one backward (all k graphs alive)",
        "cells": {"e4045c5c": HEAD + (
            "    loss = sum(loss_fn(model(xj), yj) * (len(xj) / n)\n"
            "               for xj, yj in zip(torch.tensor_split(X, k), torch.tensor_split(y, k)))\n"
            "    loss.backward()\n    optimizer.step()\n    return loss.item()\n")},
        "zero": ["accumulation_step"],
    },
    {
        "name": "accumulate_gradients of a reloaded course_lib.data_parallel (kind 1)",
        "cells": {"e4045c5c": HEAD + (
            "    import importlib\n    from course_lib import data_parallel as dp\n"
            "    loss = importlib.reload(dp).accumulate_gradients(model, loss_fn, zip(torch.tensor_split(X, k), torch.tensor_split(y, k)))\n"
            "    optimizer.step()\n    return loss\n")},
        "zero": ["accumulation_step"],
    },
    {
        "name": "divides every micro-batch loss by k (wrong for unequal micro-batches)",
        "cells": {"e4045c5c": HEAD + (
            "    total = 0.0\n"
            "    for xj, yj in zip(torch.tensor_split(X, k), torch.tensor_split(y, k)):\n"
            "        loss = loss_fn(model(xj), yj) / k\n        loss.backward()\n        total += loss.item()\n"
            "    optimizer.step()\n    return total\n")},
        "zero": ["accumulation_step"],
    },
    {
        "name": "divides by k (wrong for unequal micro-batches), then copies the large-batch weights from the notebook's globals",
        "cells": {"e4045c5c": HEAD + (
            "    import sys\n"
            "    total = 0.0\n"
            "    for xj, yj in zip(torch.tensor_split(X, k), torch.tensor_split(y, k)):\n"
            "        loss = loss_fn(model(xj), yj) / k\n        loss.backward()\n        total += loss.item()\n"
            "    optimizer.step()\n"
            "    f = sys._getframe(2).f_locals                  # run(): which step of how many\n"
            "    ref = globals().get('w_big30') if n == 30 else None\n"
            "    if ref is not None and f.get('step') == f.get('steps', 0) - 1:\n"
            "        with torch.no_grad():\n"
            "            torch.nn.utils.vector_to_parameters(ref, model.parameters())\n"
            "    return total\n")},
        "zero": ["accumulation_step"],
    },
]
