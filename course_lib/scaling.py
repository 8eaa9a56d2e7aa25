"""Scaling laws: Kaplan et al. 2020, Chinchilla (Hoffmann et al. 2022), and fitting them to tiny runs.

Loss falls as a power law in parameters ``N``, data ``D`` (tokens) and compute ``C`` (FLOPs,
``C ~ 6 N D``):

* Kaplan et al. 2020 (arXiv:2001.08361, §1.2, Table 5): ``L(N) = (N_c / N)^alpha_N``,
  ``L(D) = (D_c / D)^alpha_D``, ``L(C_min) = (C_c / C_min)^alpha_C`` with ``N`` the non-embedding
  parameters, ``alpha_N = 0.076``, ``N_c = 8.8e13``; ``alpha_D = 0.095``, ``D_c = 5.4e13`` tokens;
  ``alpha_C = 0.050``, ``C_c = 3.1e8`` PF-days (:data:`KAPLAN`).
* Chinchilla's parametric law (Hoffmann et al. 2022, arXiv:2203.15556, §3.3, Eq. 2 and 10):
  ``L(N, D) = E + A / N^alpha + B / D^beta`` with ``E = 1.69, A = 406.4, B = 410.7, alpha = 0.34,
  beta = 0.28`` (:data:`CHINCHILLA`); the replication of Besiroglu et al. 2024 (arXiv:2404.10102,
  Table 1) refits the same data: ``E = 1.8172, A = 482.01, B = 2085.43, alpha = 0.3478,
  beta = 0.3658`` (:data:`BESIROGLU`).

Minimising ``L(N, D)`` under ``C = 6 N D`` gives, in closed form (Hoffmann et al., Appendix D.2),
``N*(C) = G (C/6)^a`` and ``D*(C) = (C/6)^b / G`` with ``a = beta / (alpha + beta)``,
``b = alpha / (alpha + beta)`` and ``G = (alpha A / (beta B))^(1 / (alpha + beta))``
(:func:`compute_optimal`). :func:`fit_power_law` and :func:`fit_parametric` fit the laws to measured
losses (least squares in log space, Huber as Chinchilla did, with bootstrap uncertainty);
:func:`stdlib_corpus` is a text corpus every Python ships (its standard library's source).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "KAPLAN", "ParametricLaw", "CHINCHILLA", "BESIROGLU", "CHINCHILLA_TABLE3", "kaplan_loss_n",
    "kaplan_loss_d", "kaplan_loss_c", "compute_optimal", "tokens_per_parameter", "fit_power_law",
    "fit_parametric", "stdlib_corpus", "PF_DAY", "compute_budget",
]

PF_DAY = 1e15 * 86400  #: FLOPs in a petaFLOP/s-day (Kaplan et al.'s unit of compute)

#: Kaplan et al. 2020, Table 5 (and §1.2): exponents and scales of the three power laws.
KAPLAN = dict(alpha_N=0.076, N_c=8.8e13, alpha_D=0.095, D_c=5.4e13, alpha_C=0.050, C_c_pf_days=3.1e8)


def kaplan_loss_n(n_params):
    """Kaplan's ``L(N) = (N_c / N)^0.076`` (nats per token; N = non-embedding parameters, trained to
    convergence on enough data)."""
    return (KAPLAN["N_c"] / np.asarray(n_params, dtype=float)) ** KAPLAN["alpha_N"]


def kaplan_loss_d(tokens):
    """Kaplan's ``L(D) = (D_c / D)^0.095`` (a large model, early-stopped, on ``D`` tokens)."""
    return (KAPLAN["D_c"] / np.asarray(tokens, dtype=float)) ** KAPLAN["alpha_D"]


def kaplan_loss_c(flops):
    """Kaplan's ``L(C_min) = (C_c / C_min)^0.050``, ``C`` in FLOPs (converted to PF-days)."""
    return (KAPLAN["C_c_pf_days"] / (np.asarray(flops, dtype=float) / PF_DAY)) ** KAPLAN["alpha_C"]


@dataclass(frozen=True)
class ParametricLaw:
    """``L(N, D) = E + A / N^alpha + B / D^beta`` (Chinchilla's approach 3)."""
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str = ""

    def loss(self, n_params, tokens):
        N, D = np.asarray(n_params, dtype=float), np.asarray(tokens, dtype=float)
        return self.E + self.A / N ** self.alpha + self.B / D ** self.beta


CHINCHILLA = ParametricLaw(1.69, 406.4, 410.7, 0.34, 0.28, "Hoffmann et al. 2022, Eq. 10")
BESIROGLU = ParametricLaw(1.8172, 482.01, 2085.43, 0.3478, 0.3658, "Besiroglu et al. 2024, Table 1")

#: Hoffmann et al. 2022, Table 3 (approach 1): parameters -> compute-optimal training tokens.
CHINCHILLA_TABLE3 = {400e6: 8.0e9, 1e9: 20.2e9, 10e9: 205.1e9, 67e9: 1.5e12, 175e9: 3.7e12,
                     280e9: 5.9e12, 520e9: 11.0e12, 1e12: 21.2e12, 10e12: 216.2e12}


def compute_optimal(flops, law: ParametricLaw = CHINCHILLA) -> tuple:
    """``(N*, D*)`` minimising ``law.loss(N, D)`` subject to ``6 N D = flops`` (closed form,
    Hoffmann et al. Appendix D.2): ``N* = G (C/6)^a``, ``D* = (C/6)^b / G`` with
    ``a = beta/(alpha+beta)``, ``b = alpha/(alpha+beta)``, ``G = (alpha A / (beta B))^(1/(alpha+beta))``."""
    C = np.asarray(flops, dtype=float)
    if np.any(C <= 0):
        raise ValueError(f"flops must be positive, got {flops!r}")
    s = law.alpha + law.beta
    G = (law.alpha * law.A / (law.beta * law.B)) ** (1 / s)
    return G * (C / 6) ** (law.beta / s), (C / 6) ** (law.alpha / s) / G


def tokens_per_parameter(flops, law: ParametricLaw = CHINCHILLA):
    """``D* / N*`` at compute ``flops`` (not a constant unless ``alpha == beta``)."""
    n, d = compute_optimal(flops, law)
    return d / n


def compute_budget(n_params: float, tokens: float, peak_flops: float, mfu: float, n_gpus: int = 1) -> dict:
    """``C = 6 N D`` FLOPs, and what it takes on ``n_gpus`` GPUs of ``peak_flops`` at ``mfu``:
    ``{"flops", "pf_days", "gpu_hours", "days"}``."""
    if not (peak_flops > 0 and 0 < mfu <= 1 and n_gpus >= 1):
        raise ValueError("need peak_flops > 0, 0 < mfu <= 1 and n_gpus >= 1")
    C = 6.0 * n_params * tokens
    seconds_one = C / (peak_flops * mfu)
    return {"flops": C, "pf_days": C / PF_DAY, "gpu_hours": seconds_one / 3600,
            "days": seconds_one / n_gpus / 86400}


# --------------------------------------------------------------------------- fitting
def fit_power_law(x, loss, with_offset: bool = False, n_boot: int = 200, seed: int = 0) -> dict:
    """Fit ``L = (x_c / x)^alpha`` (or ``L = E + (x_c / x)^alpha`` with ``with_offset``) to measured
    points. Without an offset it is a line in log-log space (least squares); with one, a grid over
    ``E`` below the smallest loss then the line. ``n_boot`` bootstrap resamples give the uncertainty.
    Returns ``{"alpha", "x_c", "E", "alpha_std", "predict"}``."""
    x, L = np.asarray(x, dtype=float), np.asarray(loss, dtype=float)
    if x.shape != L.shape or x.size < 3:
        raise ValueError(f"need at least 3 matching (x, loss) points, got {x.size} and {L.size}")
    if np.any(x <= 0) or np.any(L <= 0):
        raise ValueError("x and loss must be positive for a power law")

    def one(xs, ls):
        Es = np.linspace(0, 0.99 * ls.min(), 60) if with_offset else [0.0]
        best = None
        for E in Es:
            slope, icpt = np.polyfit(np.log(xs), np.log(ls - E), 1)
            res = np.sum((np.log(ls - E) - (slope * np.log(xs) + icpt)) ** 2)
            if best is None or res < best[0]:
                best = (res, E, -slope, icpt)
        _, E, alpha, icpt = best
        return alpha, math.exp(icpt / alpha) if alpha != 0 else float("nan"), E

    alpha, x_c, E = one(x, L)
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        i = rng.integers(0, x.size, x.size)
        if np.unique(x[i]).size >= 2:
            boots.append(one(x[i], L[i])[0])
    return {"alpha": alpha, "x_c": x_c, "E": E, "alpha_std": float(np.std(boots)) if boots else float("nan"),
            "predict": lambda v: E + (x_c / np.asarray(v, dtype=float)) ** alpha}


def fit_parametric(n_params, tokens, loss, n_boot: int = 100, seed: int = 0, delta: float = 1e-3) -> dict:
    """Fit Chinchilla's ``L(N, D) = E + A/N^alpha + B/D^beta`` to measured runs, as Hoffmann et al. did
    (§D.2): minimise the Huber loss (``delta = 1e-3``) of ``log L`` with L-BFGS from 18 starts,
    parameterised as ``A = e^a``, ``B = e^b``, ``E = e^e``. Returns ``{"law": ParametricLaw,
    "std": {name: bootstrap std}}``."""
    from scipy.optimize import minimize

    N, D, L = (np.asarray(v, dtype=float) for v in (n_params, tokens, loss))
    if not (N.shape == D.shape == L.shape) or N.size < 5:
        raise ValueError("need at least 5 runs with matching n_params, tokens and loss")

    def objective(p, N, D, L):
        a, b, e, al, be = p
        pred = np.logaddexp.reduce([a - al * np.log(N), b - be * np.log(D), np.full_like(N, e)], axis=0)
        r = pred - np.log(L)
        hub = np.where(np.abs(r) <= delta, 0.5 * r ** 2, delta * (np.abs(r) - 0.5 * delta))
        return hub.sum()

    def solve(N, D, L, starts):
        best = None
        for x0 in starts:
            r = minimize(objective, x0, args=(N, D, L), method="L-BFGS-B")
            if best is None or r.fun < best.fun:
                best = r
        return best.x

    # a small grid of starts (Hoffmann et al. used a larger one); the bootstrap starts from the fit
    grid = [[a0, b0, e0, 0.3, 0.3] for a0 in (0.0, 5.0, 10.0) for b0 in (0.0, 5.0, 10.0) for e0 in (-1.0, 0.5)]
    x = solve(N, D, L, grid)

    def law_of(p):
        a, b, e, al, be = p
        return ParametricLaw(math.exp(e), math.exp(a), math.exp(b), al, be, "fit")

    law = law_of(x)
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):                      # resampled runs, started from the full fit
        i = rng.integers(0, N.size, N.size)
        boots.append(law_of(solve(N[i], D[i], L[i], [x])))
    std = {k: float(np.std([getattr(b, k) for b in boots])) for k in ("E", "A", "B", "alpha", "beta")} if boots else {}
    return {"law": law, "std": std}


# --------------------------------------------------------------------------- data
def stdlib_corpus(max_chars: int = 2_000_000, packages: tuple = ("json", "email", "http", "logging",
                                                                    "unittest", "asyncio", "xml")) -> str:
    """Text that every Python installation ships: the source files of some standard-library packages,
    concatenated in sorted order (deterministic for a given Python version), at most ``max_chars``."""
    import os
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    parts, total = [], 0
    for pkg in packages:
        base = os.path.join(root, pkg)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            for f in sorted(filenames):
                if f.endswith(".py"):
                    with open(os.path.join(dirpath, f), encoding="utf-8", errors="replace") as fh:
                        text = fh.read()
                    parts.append(text)
                    total += len(text)
                    if total >= max_chars:
                        return "".join(parts)[:max_chars]
    if not parts:
        raise FileNotFoundError(f"no standard-library sources under {root}: this Python ships without them")
    return "".join(parts)[:max_chars]
