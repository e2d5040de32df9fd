"""Patient-level DP (issue #11): the privacy unit is the patient, not the frame.

Group privacy of record-level claims, per-patient clipping against a per-patient loop, the
patient sampling rate the accountant gets, the site's enforcement of its unit (P11, P12) and
the claims of both units.
"""

from __future__ import annotations

import math

import pytest


# ---------------------------------------------------------------------------
# group privacy
# ---------------------------------------------------------------------------


def _group_by_induction(epsilon: float, delta: float, k: int) -> tuple[float, float]:
    """Independent computation: chain D_0 ~ D_1 ~ ... ~ D_k one neighbour at a time.

    P[M(D_0) in S] <= e^eps P[M(D_1) in S] + delta, and by induction on j:
    P[M(D_0) in S] <= e^(j eps) P[M(D_j) in S] + delta_j with delta_{j+1} = e^eps delta_j + delta.
    """
    eps_j, delta_j = epsilon, delta
    for _ in range(k - 1):
        eps_j, delta_j = eps_j + epsilon, math.exp(epsilon) * delta_j + delta
    return eps_j, delta_j


@pytest.mark.parametrize("epsilon, delta, k", [(0.8, 1e-5, 8), (0.2, 1e-6, 1), (1.5, 1e-5, 3), (0.05, 1e-5, 40)])
def test_group_privacy_matches_the_induction_and_the_upper_form(epsilon, delta, k):
    from shared.privacy.group import group_privacy

    eps_k, delta_k = group_privacy(epsilon=epsilon, delta=delta, k=k)
    want_eps, want_delta = _group_by_induction(epsilon, delta, k)
    assert eps_k == pytest.approx(want_eps, rel=1e-12)
    assert delta_k == pytest.approx(want_delta, rel=1e-12)
    assert delta_k <= k * math.exp((k - 1) * epsilon) * delta * (1 + 1e-12)  # the k e^((k-1) eps) delta form


def test_group_privacy_at_the_issue_example_and_validation():
    from shared.privacy.group import group_privacy

    eps_k, delta_k = group_privacy(epsilon=0.8, delta=1e-5, k=8)
    assert eps_k == pytest.approx(6.4)
    assert 4.8e-3 < delta_k < 5.0e-3  # 1e-5 (e^6.4 - 1) / (e^0.8 - 1)
    for bad in ({"k": 0}, {"k": 2.5}, {"k": True}, {"epsilon": -1.0}, {"delta": 1.0}):
        with pytest.raises(ValueError):
            group_privacy(**{"epsilon": 0.8, "delta": 1e-5, "k": 8, **bad})
