"""The one-run audit bound (Steinke, Nasr, Jagielski, NeurIPS 2023), checked against independent numbers.

Setting of the paper (its Theorem 5.2 with Algorithm 2 of its appendix): m canaries, each included
independently with probability 1/2 (S_i uniform in {-1, +1}); the auditor guesses r of them
(T_i in {-1, +1}, the rest abstain) and W is its number of correct guesses. If the training algorithm
is (eps, delta)-DP in each canary then for every v

    P[W >= v] <= beta + alpha * 2 m delta,
    beta  = P[Binomial(r, q) >= v],                       q = e^eps / (1 + e^eps)
    alpha = max_{i = 1..v} (1 / i) P[v - i <= Binomial(r, q) < v].

For delta = 0 the bound is the plain binomial tail: an eps-DP algorithm makes every guess behave like
eps-randomized response, correct with probability at most q. The lower bound eps_LB at confidence
1 - a is the largest eps whose bound is still < a, i.e. the largest eps rejected by the observation.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from fedpose.shared.privacy.audit.bound import audit_p_value, count_correct, epsilon_lower_bound


def logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def test_delta_zero_is_the_clopper_pearson_bound_in_logit_units():
    # P[Binomial(r, q) >= v] = I_q(v, r - v + 1) (regularised incomplete beta), so the q at which the
    # tail equals 0.05 is the 5% quantile of Beta(v, r - v + 1): the one-sided Clopper-Pearson lower
    # bound of the guess accuracy. eps_LB = logit of it.
    for m, r, v in ((1000, 100, 95), (1000, 100, 100), (1000, 200, 130), (50, 10, 9)):
        q_low = stats.beta.ppf(0.05, v, r - v + 1)
        assert epsilon_lower_bound(m=m, r=r, v=v, delta=0.0, confidence=0.95) == pytest.approx(
            logit(q_low), abs=2e-3
        )


def test_all_correct_has_a_closed_form_for_delta_zero():
    # v = r = 100: P[Binomial(100, q) >= 100] = q^100 = 0.05  =>  q = 0.05^(1/100) = 0.970487...
    q = 0.05 ** (1 / 100)
    assert q == pytest.approx(0.9704869, abs=1e-6)
    assert logit(q) == pytest.approx(3.4930, abs=1e-3)
    assert epsilon_lower_bound(m=1000, r=100, v=100, delta=0.0) == pytest.approx(logit(q), abs=1e-3)


def _p_exact(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """The theorem's bound in exact rational arithmetic (q rounded once to a Fraction), from the sums."""
    q = Fraction(1.0 / (1.0 + math.exp(-eps)))
    pmf = [math.comb(r, k) * q**k * (1 - q) ** (r - k) for k in range(r + 1)]
    beta = sum(pmf[v:], Fraction(0))
    alpha = max(sum(pmf[v - i : v], Fraction(0)) / i for i in range(1, v + 1)) if v > 0 else Fraction(0)
    return min(1.0, float(beta + alpha * 2 * m * Fraction(delta)))


@pytest.mark.parametrize("v", [95, 100])
def test_p_value_with_delta_matches_exact_arithmetic(v):
    for eps in (0.5, 1.0, 2.0, 3.0, 4.0):
        assert audit_p_value(m=1000, r=100, v=v, epsilon=eps, delta=1e-5) == pytest.approx(
            _p_exact(1000, 100, v, eps, 1e-5), rel=1e-9, abs=1e-300
        )


def test_pinned_lower_bounds_with_delta():
    # Pinned from the exact-arithmetic bound above (bisection on eps, p < 0.05):
    # m = 1000, r = 100, delta = 1e-5.
    def by_bisection(v: int) -> float:
        lo, hi = 0.0, 8.0
        for _ in range(16):  # 8 / 2^16 = 1.2e-4
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if _p_exact(1000, 100, v, mid, 1e-5) < 0.05 else (lo, mid)
        return lo

    for v in (95, 100):
        expected = by_bisection(v)
        got = epsilon_lower_bound(m=1000, r=100, v=v, delta=1e-5)
        assert got == pytest.approx(expected, abs=2e-3)
        # the delta term can only weaken the bound
        assert got <= epsilon_lower_bound(m=1000, r=100, v=v, delta=0.0) + 1e-9
    assert epsilon_lower_bound(m=1000, r=100, v=100, delta=1e-5) == pytest.approx(3.465, abs=0.005)
    assert epsilon_lower_bound(m=1000, r=100, v=95, delta=1e-5) == pytest.approx(2.165, abs=0.005)


def test_chance_level_gives_zero_and_inputs_are_checked():
    assert epsilon_lower_bound(m=1000, r=100, v=50, delta=1e-5) == 0.0
    assert epsilon_lower_bound(m=1000, r=0, v=0, delta=1e-5) == 0.0
    with pytest.raises(ValueError, match="v <= r <= m"):
        epsilon_lower_bound(m=10, r=20, v=5, delta=1e-5)
    with pytest.raises(ValueError, match="confidence"):
        epsilon_lower_bound(m=10, r=5, v=5, delta=1e-5, confidence=1.5)
    with pytest.raises(ValueError, match="delta"):
        audit_p_value(m=10, r=5, v=5, epsilon=1.0, delta=-1.0)


def test_count_correct_guesses_top_in_bottom_out():
    scores = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    included = np.array([True, True, False, True, False, False])
    # top 2 guessed IN (both right), bottom 2 guessed OUT (both right): r = 4, v = 4
    assert count_correct(scores, included, k_pos=2, k_neg=2) == (4, 4)
    # top 3 IN: one wrong (index 2); bottom 3 OUT: one wrong (index 3)
    assert count_correct(scores, included, k_pos=3, k_neg=3) == (6, 4)
    with pytest.raises(ValueError, match="k_pos"):
        count_correct(scores, included, k_pos=4, k_neg=3)
