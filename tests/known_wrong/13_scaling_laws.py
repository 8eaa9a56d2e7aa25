"""Shortcuts a learner would try in exercises/13_scaling_laws.ipynb; each must score zero where listed."""
OPT = '''def optimal_allocation(C, E, A, B, alpha, beta):
{body}
'''
FIT = '''def fit_offset_power_law(N, L):
    N, L = np.asarray(N, dtype=float), np.asarray(L, dtype=float)
{body}
'''
DAYS = '''def training_days(n_params, tokens, peak_flops, mfu, n_gpus):
{body}
'''

CASES = [
    {
        "name": "the 20-tokens-per-parameter rule instead of the law (N = sqrt(C / 120))",
        "cells": {"ex1-code": OPT.format(body="    N = (C / 120) ** 0.5\n    return N, 20 * N")},
        "zero": ["optimal_allocation"],
    },
    {
        "name": "exponents swapped: N ~ C^(alpha / (alpha + beta))",
        "cells": {"ex1-code": OPT.format(body=(
            "    s = alpha + beta\n    G = (alpha * A / (beta * B)) ** (1 / s)\n"
            "    N = G * (C / 6) ** (alpha / s)\n    return N, C / (6 * N)"))},
        "zero": ["optimal_allocation"],
    },
    {
        "name": "calls course_lib.scaling.compute_optimal (switched off during the check)",
        "cells": {"ex1-code": OPT.format(body=(
            "    from course_lib import scaling\n"
            "    return scaling.compute_optimal(C, scaling.ParametricLaw(E, A, B, alpha, beta))"))},
        "zero": ["optimal_allocation"],
    },
    {
        "name": "forgets the MFU (assumes the GPUs run at peak)",
        "cells": {"ex2-code": DAYS.format(body="    return 6 * n_params * tokens / (peak_flops * n_gpus) / 86400")},
        "zero": ["training_days"],
    },
    {
        "name": "counts 2ND (the forward pass only)",
        "cells": {"ex2-code": DAYS.format(body="    return 2 * n_params * tokens / (peak_flops * mfu * n_gpus) / 86400")},
        "zero": ["training_days"],
    },
]
CASES += [
    {
        "name": "a straight line in log-log space (assumes the offset c is 0)",
        "cells": {"ex3-code": FIT.format(body=(
            "    slope, icpt = np.polyfit(np.log(N), np.log(L), 1)\n"
            "    return float(np.exp(icpt)), float(-slope), 0.0"))},
        "zero": ["offset_power_law"],
    },
]
