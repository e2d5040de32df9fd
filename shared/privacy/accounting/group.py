"""Group privacy: what a record-level (eps, delta) guarantee says about a patient with k records.

A patient filmed in k frames differs from "no such patient" by k records, so a
record-level guarantee protects the patient only through group privacy
(Dwork and Roth 2014, section 2.3; Vadhan 2017, Lemma 2.2 for the delta term).
Chaining k neighbouring datasets D_0 ~ D_1 ~ ... ~ D_k:

    P[M(D_0) in S] <= e^eps P[M(D_1) in S] + delta
                   <= e^(2 eps) P[M(D_2) in S] + e^eps delta + delta
                   ...
                   <= e^(k eps) P[M(D_k) in S] + delta sum_{i=0}^{k-1} e^(i eps)

so the mechanism is (k eps, delta_k)-DP for groups of k with
delta_k = delta (e^(k eps) - 1) / (e^eps - 1). That is the exact value of the
chaining argument; the often quoted k e^((k-1) eps) delta is an upper bound on
it. At eps 0.8, delta 1e-5 and k = 8: (6.4, 4.9e-3).

This is a conversion of the (eps, delta) pair, not of the underlying RDP
curve: an accountant that tracked groups directly (the sampled Gaussian with
sensitivity k C) could give a tighter pair. What fedpose offers instead, for a
patient, is patient-level DP (``privacy.unit: patient``).
"""

from __future__ import annotations

import math


def group_privacy(*, epsilon: float, delta: float, k: int) -> tuple[float, float]:
    """(k eps, delta sum_{i<k} e^(i eps)): the (eps, delta)-DP guarantee for a group of ``k`` records.

    The delta returned may be >= 1, or inf past float range (then the pair promises nothing); callers say so.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} must be an int >= 1 (records of one patient)")
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not (
            epsilon >= 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon={epsilon!r} must be a finite number >= 0")
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 <= delta < 1:
        raise ValueError(f"delta={delta!r} must be in [0, 1)")
    if epsilon == 0:
        return 0.0, k * float(delta)
    if k == 1:  # a group of one record: the guarantee itself
        return float(epsilon), float(delta)
    if k * epsilon < _EXP_LIMIT:
        # sum_{i=0}^{k-1} e^(i eps) = expm1(k eps) / expm1(eps), accurate for small eps
        return k * float(epsilon), float(delta) * math.expm1(k * epsilon) / math.expm1(epsilon)
    if delta == 0:
        return k * float(epsilon), 0.0
    # e^(k eps) overflows: log of delta e^((k - 1) eps) (1 - e^(-k eps)) / (1 - e^(-eps))
    log_delta = (math.log(delta) + (k - 1) * epsilon + math.log(-math.expm1(-k * epsilon))
                 - math.log(-math.expm1(-epsilon)))
    return k * float(epsilon), math.exp(log_delta) if log_delta < _EXP_LIMIT else math.inf


_EXP_LIMIT = 700.0  # math.exp overflows past about 709.78
