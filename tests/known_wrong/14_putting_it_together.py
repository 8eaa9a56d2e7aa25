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
            "    return M.Layout(dp, 1, 1, 1, model.global_batch // dp), 0, 'none'"))},
        "zero": ["choose_layout"],
    },
    {
        "name": "asks the library's planner (course_lib.mesh.plan_layouts, switched off during the check)",
        "cells": {"ex1-code": LAYOUT.format(body="    return M.plan_layouts(model, cluster)[0], 1, 'selective'")},
        "zero": ["choose_layout"],
    },
    {
        "name": "the layout with the least memory (fits, but ignores the step time)",
        "cells": {"ex1-code": LAYOUT.format(body=(
            "    cands = [(memory_bytes(model, cluster, l, z, r), l, z, r)\n"
            "             for l in M.enumerate_layouts(model, cluster.world_size, (1, 2, 4, 8)) for z, r in SETTINGS]\n"
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
            "    fit = [l for l in M.enumerate_layouts(model, cluster.world_size, (1, 2, 4, 8)) if fits(model, cluster, l, 1, 'selective')]\n"
            "    return min(fit, key=lambda l: step_seconds(model, cluster, l, 1, 'selective')), 1, 'selective'"))},
        "zero": ["choose_layout"],
    },
    {
        "name": "leaves the costs of full recomputation and ZeRO-3 out (the planner's step time for every setting)",
        "cells": {"ex1-code": LAYOUT.format(body=(
            "    cands = [(M.layout_step_time(model, cluster, l)['step'], l, z, r)\n"
            "             for l in M.enumerate_layouts(model, cluster.world_size, (1, 2, 4, 8)) for z, r in SETTINGS\n"
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
        "name": "copies the expected bill from the check's frame",
        "cells": {"ex2-code": COST.format(body=(
            "    import sys\n"
            "    f = sys._getframe(1)\n"
            "    while f is not None and 'want' not in f.f_locals:\n"
            "        f = f.f_back\n"
            "    return dict(f.f_locals['want'])"))},
        "zero": ["cost_estimate"],
    },
]
