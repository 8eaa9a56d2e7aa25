"""Scaling laws (course_lib.scaling): the published laws, the closed-form optimum against a numerical
one, budgets, and the fits recovering known laws from synthetic points."""

from __future__ import annotations

import math

import numpy as np
import pytest

from course_lib import scaling as S


@pytest.mark.parametrize("law", [S.CHINCHILLA, S.BESIROGLU, S.ParametricLaw(0.5, 10.0, 50.0, 0.6, 0.2)])
@pytest.mark.parametrize("C", [1e18, 5.76e23, 1e26])
def test_compute_optimal_is_the_minimum_on_the_budget(law, C):
    from scipy.optimize import minimize_scalar
    n, d = S.compute_optimal(C, law)
    assert 6 * n * d == pytest.approx(C, rel=1e-9)
    r = minimize_scalar(lambda u: law.loss(math.exp(u), C / (6 * math.exp(u))), bounds=(0, math.log(C / 6)),
                        method="bounded", options={"xatol": 1e-10})
    assert n == pytest.approx(math.exp(r.x), rel=1e-4)


def test_published_numbers():
    assert float(S.kaplan_loss_n(S.KAPLAN["N_c"])) == pytest.approx(1.0)
    assert 10 ** -S.KAPLAN["alpha_N"] == pytest.approx(0.839, abs=1e-3)
    # Besiroglu's refit gives about 20 tokens per parameter at Chinchilla's budget; the published fit does not
    assert 15 < float(S.tokens_per_parameter(5.76e23, S.BESIROGLU)) < 25
    assert float(S.tokens_per_parameter(5.76e23, S.CHINCHILLA)) > 60
    b = S.compute_budget(65.2e9, 1.4e12, 312e12, 1.0, 2048)
    assert b["flops"] == pytest.approx(5.477e23, rel=1e-3) and 21 / b["days"] == pytest.approx(1 / 0.472, rel=0.01)
    with pytest.raises(ValueError, match="flops must be positive"):
        S.compute_optimal(0)
    with pytest.raises(ValueError, match="0 < mfu <= 1"):
        S.compute_budget(1e9, 1e9, 1e12, 1.5)


def test_fits_recover_known_laws():
    x = np.logspace(3, 6, 8)
    f = S.fit_power_law(x, (2e4 / x) ** 0.3)
    assert f["alpha"] == pytest.approx(0.3, abs=1e-6) and f["x_c"] == pytest.approx(2e4, rel=1e-4)
    g = S.fit_power_law(x, 1.5 + (2e4 / x) ** 0.3, with_offset=True)
    assert g["alpha"] == pytest.approx(0.3, abs=0.05) and g["E"] == pytest.approx(1.5, abs=0.1)
    N = np.repeat(np.logspace(7, 10, 5), 5)
    D = np.tile(np.logspace(9, 12, 5), 5)
    law = S.ParametricLaw(1.7, 400.0, 400.0, 0.34, 0.28)
    fit = S.fit_parametric(N, D, law.loss(N, D), n_boot=3)["law"]
    assert fit.alpha == pytest.approx(0.34, abs=0.02) and fit.beta == pytest.approx(0.28, abs=0.02)
    assert fit.E == pytest.approx(1.7, abs=0.05)
    with pytest.raises(ValueError, match="at least 3 matching"):
        S.fit_power_law([1, 2], [1, 2])


def test_stdlib_corpus_is_text_that_every_python_ships():
    text = S.stdlib_corpus(100_000)
    assert len(text) == 100_000 and "def " in text and text == S.stdlib_corpus(100_000)
