"""Shortcuts a learner would try in exercises/08_pipeline_parallel.ipynb; each must score zero where listed.

A wrong schedule also makes the training step built on it wrong (a different order, or it cannot run), so
those cases list both checks.
"""
GEN = '''def one_f_one_b(p, m):
{body}
'''
STEP = '''def pipeline_step(model, x, y, m, group=None):
    import torch.distributed as dist
{body}
'''
LOOP_1F1B = ("        acts = [Action(\"F\", r, i) for i in range(warm)]\n"
             "        for k in range(m - warm):\n"
             "            acts += [Action(\"F\", r, warm + k), Action(\"B\", r, k)]\n"
             "        acts += [Action(\"B\", r, i) for i in range(m - warm, m)]\n"
             "        schedule.append(acts)\n"
             "    return schedule")

CASES = [
    {
        "name": "returns GPipe (all forwards, then all backwards): valid, same bubble, holds m micro-batches",
        "cells": {"ex1-code": GEN.format(body=(
            "    return [[Action(\"F\", r, i) for i in range(m)] + [Action(\"B\", r, i) for i in reversed(range(m))]\n"
            "            for r in range(p)]"))},
        "zero": ["one_f_one_b", "pipeline_step"],
    },
    {
        "name": "warms up with p - r forwards (one too many: holds p - r + 1)",
        "cells": {"ex1-code": GEN.format(body=(
            "    schedule = []\n    for r in range(p):\n        warm = min(p - r, m)\n" + LOOP_1F1B))},
        "zero": ["one_f_one_b", "pipeline_step"],
    },
    {
        "name": "cools down newest first (valid, but the ranks wait longer: a larger bubble)",
        "cells": {"ex1-code": GEN.format(body=(
            "    schedule = []\n    for r in range(p):\n        warm = min(p - r - 1, m)\n"
            + LOOP_1F1B.replace("for i in range(m - warm, m)]", "for i in reversed(range(m - warm, m))]")))},
        "zero": ["one_f_one_b", "pipeline_step"],
    },
    {
        "name": "calls course_lib.pipeline.one_f_one_b_schedule (switched off during the check)",
        "cells": {"ex1-code": GEN.format(body="    return P.one_f_one_b_schedule(p, m)")},
        "zero": ["one_f_one_b", "pipeline_step"],
    },
    {
        "name": "ignores m: the whole batch as one micro-batch (right gradients, no pipelining)",
        "cells": {"ex2-code": STEP.format(body=(
            "    p, r = dist.get_world_size(group), dist.get_rank(group)\n"
            "    stages = P.build_stages(model, P.partition(model, p), [r])\n"
            "    return P.run_schedule(one_f_one_b(p, 1), stages, [x], [y], nn.functional.mse_loss, group=group)"))},
        "zero": ["pipeline_step"],
    },
    {
        "name": "trains the whole model on every rank (right gradients, nothing split)",
        "cells": {"ex2-code": STEP.format(body=(
            "    loss = nn.functional.mse_loss(model(x), y)\n    loss.backward()\n"
            "    return {\"losses\": [loss.item()], \"loss\": loss.item()}"))},
        "zero": ["pipeline_step"],
    },
]
