"""Empirical lower bound on epsilon from one training run (Steinke, Nasr, Jagielski, NeurIPS 2023).

m canaries are each included in the training data independently with
probability 1/2. After training, an auditor scores every canary, guesses the
k_pos highest as IN and the k_neg lowest as OUT (abstaining on the rest:
r = k_pos + k_neg guesses) and counts its correct guesses v. The paper's
Theorem 5.2 (computed as in its Algorithm 2) says that if training is
(eps, delta)-DP with respect to each canary, then for every v

    P[W >= v] <= beta + alpha * 2 m delta
    beta  = P[Binomial(r, q) >= v]                               q = e^eps / (1 + e^eps)
    alpha = max_{i = 1..v} (1 / i) * P[v - i <= Binomial(r, q) < v]

(for delta = 0 the bound is beta: each guess is no better than
eps-randomized response). An observed v with bound < 1 - confidence rejects
"(eps, delta)-DP"; eps_LB is the largest eps so rejected. eps_LB is a
statement about this run: a sound mechanism gives eps_LB <= eps except with
probability 1 - confidence; a low eps_LB does NOT show that the claim is
tight, only that this attack could not see more.
"""

from __future__ import annotations

import logging
import math

import numpy as np
from scipy import stats

log = logging.getLogger(__name__)

# Bisection on eps: precision and the largest eps the search considers.
_EPS_TOL = 1e-4
_EPS_MAX = 64.0


def _check_counts(m: int, r: int, v: int) -> None:
    for name, value in (("m", m), ("r", r), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name}={value!r} must be an int")
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m (correct guesses <= guesses <= canaries), got m={m}, r={r}, v={v}")


def _check_delta(delta: float) -> float:
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 <= delta <= 1:
        raise ValueError(f"delta={delta!r} must be in [0, 1]")
    return float(delta)


def audit_p_value(*, m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[>= v correct of r guesses] for an (epsilon, delta)-DP algorithm (Theorem 5.2)."""
    _check_counts(m, r, v)
    delta = _check_delta(delta)
    if not (epsilon >= 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon={epsilon!r} must be finite and >= 0")
    if v == 0:
        return 1.0
    q = 1.0 / (1.0 + math.exp(-epsilon))  # accuracy of eps-randomized response
    beta = float(stats.binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]
    if delta == 0.0:
        return min(1.0, beta)
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)  # P[B = v-1], P[B = v-2], ..., P[B = 0]
    alpha = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))  # max_i P[v-i <= B < v] / i
    return min(1.0, beta + alpha * 2.0 * m * delta)


def epsilon_lower_bound(*, m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """Largest eps that ``v`` correct of ``r`` guesses on ``m`` canaries rejects at ``confidence``; 0 if none."""
    _check_counts(m, r, v)
    _check_delta(delta)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} must be in (0, 1), e.g. 0.95")
    level = 1.0 - confidence

    def rejected(eps: float) -> bool:
        return audit_p_value(m=m, r=r, v=v, epsilon=eps, delta=delta) < level

    if not rejected(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while rejected(hi):  # the bound grows with eps (to 1 as eps -> inf, or beta = 1 when v <= r q)
        lo, hi = hi, 2.0 * hi
        if hi > _EPS_MAX:
            return lo
    while hi - lo > _EPS_TOL:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if rejected(mid) else (lo, mid)
    return lo


def count_correct(scores: np.ndarray, included: np.ndarray, *, k_pos: int, k_neg: int) -> tuple[int, int]:
    """(r, v): guess the ``k_pos`` highest scores IN and the ``k_neg`` lowest OUT; v counts the right ones.

    Ties are broken by canary index (stable sort), which does not depend on
    ``included``, so the guesses are a function of the scores alone.
    """
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    m = scores.shape[0]
    if scores.ndim != 1 or included.shape != (m,):
        raise ValueError(f"scores {scores.shape} and included {included.shape} must both be (m,)")
    if not np.all(np.isfinite(scores)):
        raise ValueError("canary scores contain NaN/inf")
    if k_pos < 0 or k_neg < 0 or k_pos + k_neg > m:
        raise ValueError(f"k_pos={k_pos} and k_neg={k_neg} must be >= 0 with k_pos + k_neg <= m={m}")
    order = np.argsort(-scores, kind="stable")  # highest first
    guessed_in = order[:k_pos]
    guessed_out = order[m - k_neg :] if k_neg else order[:0]
    v = int(included[guessed_in].sum()) + int((~included[guessed_out]).sum())
    return k_pos + k_neg, v


def best_lower_bound(
    scores: np.ndarray, included: np.ndarray, *, delta: float, confidence: float = 0.95,
    fractions: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
) -> dict[str, float | int]:
    """eps_LB over a fixed grid of guess counts, each tested at (1 - confidence) / len(grid) (Bonferroni).

    The auditor does not know in advance how many guesses it can afford, so
    it tries r = fraction x m for every fraction (half IN from the top, half
    OUT from the bottom). Testing several r on the same run is multiple
    testing; dividing the error level by the number of tests (union bound)
    keeps the reported maximum valid at ``confidence``.
    """
    m = int(np.asarray(scores).shape[0])
    per_test = 1.0 - (1.0 - confidence) / len(fractions)
    best: dict[str, float | int] = {"epsilon_lb": 0.0, "r": 0, "v": 0, "k_pos": 0, "k_neg": 0}
    for fraction in fractions:
        r = max(2, int(round(fraction * m)))
        r -= r % 2
        if r > m:
            continue
        k = r // 2
        r, v = count_correct(scores, included, k_pos=k, k_neg=k)
        eps = epsilon_lower_bound(m=m, r=r, v=v, delta=delta, confidence=per_test)
        if eps > best["epsilon_lb"] or best["r"] == 0:
            best = {"epsilon_lb": eps, "r": r, "v": v, "k_pos": k, "k_neg": k}
    best["tests"] = len(fractions)
    best["confidence"] = confidence
    return best
