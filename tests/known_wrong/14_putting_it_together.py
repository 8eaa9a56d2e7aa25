"""Shortcuts a learner would try in exercises/14_putting_it_together.ipynb; each must score zero where listed."""
LAYOUT = '''def choose_layout(model, cluster):
{body}
'''
COST = '''def cost_estimate(n_params, tokens, peak_flops, mfu, gpu_hour_price, gpu_power_watts, pue):
{body}
'''
HOURS = "    gpu_hours = {flops} / ({rate}) / 3600\n"
BILL = ("    return {{'gpu_hours': gpu_hours, 'dollars': gpu_hours * gpu_hour_price,\n"
        "            'energy_kwh': gpu_hours * gpu_power_watts / 1000{pue}}}")

CASES = [
    {
        "name": "pure data parallelism, nothing sharded (ignores memory: GPT-3's states alone are 2.8 TB per copy)",
        "cells": {"ex1-code": LAYOUT.format(body=(
            "    dp = cluster.world_size\n"
            "    return planner.Layout(dp, 1, 1, 1, model.global_batch // dp), 0, 'none'"))},
        "zero": ["choose_layout"],
    },
    {
        "name": "asks the library's planner (course_lib.planner.plan_layouts, switched off during the check)",
        "cells": {"ex1-code": LAYOUT.format(body="    return planner.plan_layouts(model, cluster)[0], 1, 'selective'")},
        "zero": ["choose_layout"],
    },
    {
        "name": "the layout with the least memory (fits, but ignores the step time)",
        "cells": {"ex1-code": LAYOUT.format(body=(
            "    cands = [(memory_bytes(model, cluster, l, z, r), l, z, r)\n"
            "             for l in planner.enumerate_layouts(model, cluster.world_size, (1, 2, 4, 8)) for z, r in SETTINGS]\n"
            "    return min(cands, key=lambda c: c[0])[1:]"))},
        "zero": ["choose_layout"],
    },
    {
        "name": "counts 2ND (the forward pass only)",
        "cells": {"ex2-code": COST.format(body=HOURS.format(flops="2 * n_params * tokens", rate="peak_flops * mfu")
                                          + BILL.format(pue=" * pue"))},
        "zero": ["cost_estimate"],
    },
    {
        "name": "forgets the MFU (assumes the GPUs run at peak)",
        "cells": {"ex2-code": COST.format(body=HOURS.format(flops="6 * n_params * tokens", rate="peak_flops")
                                          + BILL.format(pue=" * pue"))},
        "zero": ["cost_estimate"],
    },
    {
        "name": "forgets the PUE (counts the GPUs' power only)",
        "cells": {"ex2-code": COST.format(body=HOURS.format(flops="6 * n_params * tokens", rate="peak_flops * mfu")
                                          + BILL.format(pue=""))},
        "zero": ["cost_estimate"],
    },
    {
        "name": "calls course_lib.estimate.training_cost (switched off during the check)",
        "cells": {"ex2-code": COST.format(body=(
            "    return E.training_cost(E.training_flops(n_params, tokens), peak_flops=peak_flops, mfu=mfu,\n"
            "                           gpu_hour_price=gpu_hour_price, gpu_power_watts=gpu_power_watts, pue=pue)"))},
        "zero": ["cost_estimate"],
    },
]

# Issue 25: settings whose costs are left out or fixed (5), the GPU-hours formula from another module (3), the
# check's reference read from its frame (2).
CASES += [
    {
        "name": "always ZeRO-1 with selective recomputation (the fastest layout that fits with them)",
        "cells": {"ex1-code": LAYOUT.format(body=(
            "    fit = [l for l in planner.enumerate_layouts(model, cluster.world_size, (1, 2, 4, 8)) if fits(model, cluster, l, 1, 'selective')]\n"
            "    return min(fit, key=lambda l: step_seconds(model, cluster, l, 1, 'selective')), 1, 'selective'"))},
        "zero": ["choose_layout"],
    },
    {
        "name": "leaves the costs of full recomputation and ZeRO-3 out (the planner's step time for every setting)",
        "cells": {"ex1-code": LAYOUT.format(body=(
            "    cands = [(planner.layout_step_time(model, cluster, l)['step'], l, z, r)\n"
            "             for l in planner.enumerate_layouts(model, cluster.world_size, (1, 2, 4, 8)) for z, r in SETTINGS\n"
            "             if fits(model, cluster, l, z, r)]\n"
            "    return min(cands, key=lambda c: c[0])[1:]"))},
        "zero": ["choose_layout"],
    },
    {
        "name": "course_lib.scaling.compute_budget's GPU-hours (not in course_lib.estimate)",
        "cells": {"ex2-code": COST.format(body=(
            "    from course_lib.scaling import compute_budget\n"
            "    gpu_hours = compute_budget(n_params, tokens, peak_flops, mfu)['gpu_hours']\n")
                                          + BILL.format(pue=" * pue"))},
        "zero": ["cost_estimate"],
    },
    {
        "name": "a recompute value that is 'full' where memory is counted and 'none' where time is (it reads its callers' frames)",
        "cells": {"ex1-code": (
            "class Chameleon:\n"
            "    def __eq__(self, other):\n"
            "        import sys\n"
            "        f, names = sys._getframe(1), set()\n"
            "        while f is not None:\n"
            "            names.add(f.f_code.co_name); f = f.f_back\n"
            "        return other == ('full' if names & {'layout_memory', 'memory_bytes', 'fits'} else 'none')\n"
            "    __hash__ = object.__hash__\n"
            "    def __repr__(self):\n        return \"'full'\"\n\n\n"
            + LAYOUT.format(body=(
                "    cands = [(step_seconds(model, cluster, l, z, 'none'), l, z)\n"
                "             for l in planner.enumerate_layouts(model, cluster.world_size, (1, 2, 4, 8)) for z in (0, 1, 2, 3)\n"
                "             if fits(model, cluster, l, z, 'full')]\n"
                "    t, l, z = min(cands, key=lambda c: c[0])\n"
                "    return l, z, Chameleon()")))},
        "zero": ["choose_layout"],
    },
]
