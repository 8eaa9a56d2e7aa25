"""Shortcuts a learner would try in exercises/08_pipeline_parallel.ipynb; each must score zero where listed."""
CASES = [
    {
        "name": "returns GPipe (all forwards, then all backwards): valid, same bubble, holds m micro-batches",
        "cells": {"ex1-code": (
            "def one_f_one_b(p, m):\n"
            "    return [[Action(\"F\", r, i) for i in range(m)] + [Action(\"B\", r, i) for i in reversed(range(m))]\n"
            "            for r in range(p)]\n")},
        "zero": ["one_f_one_b", "pipeline_step"],
    },
    {
        "name": "warms up with p - r forwards (one too many: holds p - r + 1)",
        "cells": {"ex1-code": (
            "def one_f_one_b(p, m):\n"
            "    schedule = []\n"
            "    for r in range(p):\n"
            "        warm = min(p - r, m)\n"
            "        acts = [Action(\"F\", r, i) for i in range(warm)]\n"
            "        for k in range(m - warm):\n"
            "            acts += [Action(\"F\", r, warm + k), Action(\"B\", r, k)]\n"
            "        acts += [Action(\"B\", r, i) for i in range(m - warm, m)]\n"
            "        schedule.append(acts)\n"
            "    return schedule\n")},
        "zero": ["one_f_one_b", "pipeline_step"],
    },
    {
        "name": "cools down newest first (valid, but the ranks wait longer: a larger bubble)",
        "cells": {"ex1-code": (
            "def one_f_one_b(p, m):\n"
            "    schedule = []\n"
            "    for r in range(p):\n"
            "        warm = min(p - r - 1, m)\n"
            "        acts = [Action(\"F\", r, i) for i in range(warm)]\n"
            "        for k in range(m - warm):\n"
            "            acts += [Action(\"F\", r, warm + k), Action(\"B\", r, k)]\n"
            "        acts += [Action(\"B\", r, i) for i in reversed(range(m - warm, m))]\n"
            "        schedule.append(acts)\n"
            "    return schedule\n")},
        "zero": ["one_f_one_b", "pipeline_step"],
    },
    {
        "name": "1F1B from a reloaded course_lib.pipeline (fresh copies of the switched-off generators) (kind 1)",
        "cells": {"ex1-code": (
            "def one_f_one_b(p, m):\n"
            "    import importlib\n"
            "    return importlib.reload(P).one_f_one_b_schedule(p, m)\n")},
        "zero": ["one_f_one_b", "pipeline_step"],
        # the reload gives course_lib.pipeline a new Action class: the checks that follow it in the same
        # kernel would reject the solution's schedule (built with the old class) for that alone
        "own_kernel": True,
    },
    {
        "name": "ignores m: the whole batch as one micro-batch (right gradients, no pipelining)",
        "cells": {"ex2-code": (
            "def pipeline_step(model, x, y, m, group=None):\n"
            "    import torch.distributed as dist\n"
            "    p, r = dist.get_world_size(group), dist.get_rank(group)\n"
            "    stages = P.build_stages(model, P.partition(model, p), [r])\n"
            "    return P.run_schedule(one_f_one_b(p, 1), stages, [x], [y], nn.functional.mse_loss, group=group)\n")},
        "zero": ["pipeline_step"],
    },
    {
        # only the hop bytes tell: gradients, loss and the 1F1B order are all right
        "name": "runs the pipeline in float64 for accuracy (right gradients, twice the bytes on every hop)",
        "cells": {"ex2-code": (
            "def pipeline_step(model, x, y, m, group=None):\n"
            "    import torch.distributed as dist\n"
            "    p, r = dist.get_world_size(group), dist.get_rank(group)\n"
            "    model.double()\n"
            "    stages = P.build_stages(model, P.partition(model, p), [r])\n"
            "    return P.run_schedule(one_f_one_b(p, m), stages, P.split_microbatches(x.double(), m),\n"
            "                          P.split_microbatches(y.double(), m), nn.functional.mse_loss, group=group)\n")},
        "zero": ["pipeline_step"],
    },
    {
        "name": "trains the whole model on every rank (right gradients, nothing split)",
        "cells": {"ex2-code": (
            "def pipeline_step(model, x, y, m, group=None):\n"
            "    import torch.distributed as dist\n"
            "    loss = nn.functional.mse_loss(model(x), y)\n"
            "    loss.backward()\n"
            "    return {\"losses\": [loss.item()], \"loss\": loss.item()}\n")},
        "zero": ["pipeline_step"],
    },
    {
        "name": "stage from the global rank dist.get_rank() instead of the rank in the group (kind 4)",
        "cells": {"ex2-code": (
            "def pipeline_step(model, x, y, m, group=None):\n"
            "    import torch.distributed as dist\n"
            "    p, r = dist.get_world_size(group), dist.get_rank()\n"
            "    stages = P.build_stages(model, P.partition(model, p), [r])\n"
            "    return P.run_schedule(one_f_one_b(p, m), stages, P.split_microbatches(x, m),\n"
            "                          P.split_microbatches(y, m), nn.functional.mse_loss, group=group)\n")},
        "zero": ["pipeline_step"],
    },
]
