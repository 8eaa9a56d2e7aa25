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

# The five kinds of issue 25: the same formulas elsewhere in course_lib (3), numerical stand-ins that the
# old 0.1 % / 5 % slack let through (5), the check's own reference left in the notebook's globals (2).
NUMERIC = OPT.format(body=(
    "    from scipy.optimize import minimize_scalar\n"
    "    f = lambda u: E + A * math.exp(-alpha * u) + B * (C / 6) ** -beta * math.exp(beta * u)\n"
    "    r = minimize_scalar(f, bounds=(0.0, math.log(C / 6)), method='bounded', options={'xatol': 1e-12})\n"
    "    N = math.exp(r.x)\n    return N, C / (6 * N)"))
CHECKS_OWN = OPT.format(body=(
    "    N = _numeric(C, E, A, B, alpha, beta)   # the check cell's reference, a global while the check runs\n"
    "    return N, C / (6 * N)"))
LOG_SPACE = FIT.format(body=(
    "    from scipy.optimize import curve_fit\n"
    "    slope, icpt = np.polyfit(np.log(N), np.log(L - 0.9 * L.min()), 1)\n"
    "    p, _ = curve_fit(lambda n, a, al, c: np.log(a * n ** (-al) + c), N, np.log(L),\n"
    "                     p0=(np.exp(icpt), -slope, 0.9 * L.min()), maxfev=20000)\n"
    "    return tuple(map(float, p))"))
CASES += [
    {
        "name": "minimises the loss numerically (good to about 1e-8, not exact)",
        "cells": {"ex1-code": NUMERIC},
        "zero": ["optimal_allocation"],
    },
    {
        "name": "calls the check cell's own reference (_numeric) from the notebook's globals",
        "cells": {"ex1-code": CHECKS_OWN},
        "zero": ["optimal_allocation"],
    },
    {
        "name": "course_lib.estimate's training_seconds(training_flops(N, D), ...) (not in course_lib.scaling)",
        "cells": {"ex2-code": DAYS.format(body=(
            "    from course_lib import estimate\n"
            "    return estimate.training_seconds(estimate.training_flops(n_params, tokens), peak_flops, mfu, n_gpus) / 86400"))},
        "zero": ["training_days"],
    },
    {
        "name": "least squares in log space (fits log L, not L)",
        "cells": {"ex3-code": LOG_SPACE},
        "zero": ["offset_power_law"],
    },
]
