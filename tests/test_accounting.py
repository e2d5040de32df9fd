"""Tests of the accountant wrappers (invariant P5) and sigma calibration.

The numbers come from Opacus; these tests pin the wrapper's use of it: the
history format, composition over rounds, the pinned Opacus value, and that
calibration never promises more than the accountant certifies.
"""

from __future__ import annotations

import pytest

from fedpose.shared.privacy.accounting.accountant import StepRecord, calibrate_sigma, check_delta, epsilon_spent

DELTA = 1e-5


@pytest.mark.invariant("P5")
def test_pinned_opacus_rdp_value():
    # Opacus' own reference: sigma 1.5, q 0.04, 2250 steps, delta 1e-5.
    eps = epsilon_spent([StepRecord(1.5, 0.04, 2250)], delta=DELTA)
    assert eps == pytest.approx(7.32911117143, rel=1e-6)


@pytest.mark.invariant("P5")
def test_history_composes_over_rounds_and_is_never_reset():
    sigma, q = 1.1, 0.05
    one_round = epsilon_spent([StepRecord(sigma, q, 100)], delta=DELTA)
    two_rounds = epsilon_spent([StepRecord(sigma, q, 100), StepRecord(sigma, q, 100)], delta=DELTA)
    merged = epsilon_spent([StepRecord(sigma, q, 200)], delta=DELTA)
    assert two_rounds == pytest.approx(merged, rel=1e-12)
    assert two_rounds > one_round * 1.2


@pytest.mark.invariant("P5")
def test_heterogeneous_history_matches_opacus_step_by_step():
    from opacus.accountants import RDPAccountant

    history = [StepRecord(1.0, 0.02, 30), StepRecord(2.0, 0.05, 20), StepRecord(1.0, 0.02, 10)]
    ours = epsilon_spent(history, delta=DELTA)
    reference = RDPAccountant()
    for record in history:
        for _ in range(record.steps):
            reference.step(noise_multiplier=record.sigma, sample_rate=record.sample_rate)
    # interior optimal order, so Opacus' default orders give the same minimum
    assert ours == pytest.approx(reference.get_epsilon(delta=DELTA), rel=1e-9)
    assert ours > epsilon_spent(history[:2], delta=DELTA)
    assert ours == pytest.approx(epsilon_spent(history[::-1], delta=DELTA), rel=1e-12)


def test_empty_history_has_spent_nothing():
    assert epsilon_spent([], delta=DELTA) == 0.0
    assert epsilon_spent([], delta=DELTA, accountant="prv") == 0.0


def test_prv_accountant_is_available_and_tighter():
    history = [StepRecord(1.5, 0.04, 1000), StepRecord(1.5, 0.04, 1250)]
    prv = epsilon_spent(history, delta=DELTA, accountant="prv")
    rdp = epsilon_spent(history, delta=DELTA, accountant="rdp")
    assert 0.8 * rdp < prv < rdp
    assert prv > epsilon_spent(history[:1], delta=DELTA, accountant="prv")


@pytest.mark.parametrize("target", [0.2, 0.4, 0.6, 0.8, 3.0, 8.0])
@pytest.mark.parametrize(
    ("sample_rate", "steps"), [(0.01, 100), (0.01, 1000), (0.1, 100), (0.1, 1000)]
)
def test_calibration_never_overshoots_and_is_tight(target, sample_rate, steps):
    sigma = calibrate_sigma(
        target_epsilon=target, delta=DELTA, sample_rate=sample_rate, steps=steps
    )
    eps = epsilon_spent([StepRecord(sigma, sample_rate, steps)], delta=DELTA)
    assert eps <= target
    assert eps >= 0.97 * target
    # and it is (nearly) the smallest such sigma
    slightly_less = epsilon_spent([StepRecord(sigma * 0.99, sample_rate, steps)], delta=DELTA)
    assert slightly_less > target


def test_calibration_accounts_for_the_past_history():
    past = [StepRecord(1.2, 0.05, 200)]
    spent = epsilon_spent(past, delta=DELTA)
    target = spent + 1.0
    sigma = calibrate_sigma(
        target_epsilon=target, delta=DELTA, sample_rate=0.05, steps=300, history=past
    )
    total = epsilon_spent([*past, StepRecord(sigma, 0.05, 300)], delta=DELTA)
    assert target * 0.97 <= total <= target
    fresh = calibrate_sigma(target_epsilon=target, delta=DELTA, sample_rate=0.05, steps=300)
    assert sigma > fresh  # the past spending forces more noise now
    with pytest.raises(ValueError, match="already spent"):
        calibrate_sigma(
            target_epsilon=spent * 0.9, delta=DELTA, sample_rate=0.05, steps=10, history=past
        )


def test_calibration_with_prv():
    sigma = calibrate_sigma(
        target_epsilon=1.0, delta=DELTA, sample_rate=0.02, steps=200, accountant="prv"
    )
    eps = epsilon_spent([StepRecord(sigma, 0.02, 200)], delta=DELTA, accountant="prv")
    assert 0.97 <= eps <= 1.0
    rdp_sigma = calibrate_sigma(target_epsilon=1.0, delta=DELTA, sample_rate=0.02, steps=200)
    assert sigma < rdp_sigma  # the tighter accountant needs less noise


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target_epsilon": 0.0}, "target_epsilon"),
        ({"target_epsilon": -1.0}, "target_epsilon"),
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"sample_rate": 0.0}, "sample_rate"),
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"steps": 0}, "steps"),
        ({"accountant": "gdp"}, "accountant"),
    ],
)
def test_calibration_validation(kwargs, match):
    values = {"target_epsilon": 1.0, "delta": DELTA, "sample_rate": 0.1, "steps": 10, **kwargs}
    with pytest.raises(ValueError, match=match):
        calibrate_sigma(**values)


def test_check_delta_refuses_delta_at_least_one_over_n():
    check_delta(1e-4, 1000)
    with pytest.raises(ValueError, match="1/n"):
        check_delta(1e-3, 1000)
    with pytest.raises(ValueError, match="1/n"):
        check_delta(0.01, 1000)
    with pytest.raises(ValueError, match="delta"):
        check_delta(0.0, 1000)
    with pytest.raises(ValueError, match="n=0"):
        check_delta(1e-5, 0)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0.0, 0.1, 1), "sigma"),
        ((1.0, 0.0, 1), "sample_rate"),
        ((1.0, 1.1, 1), "sample_rate"),
        ((1.0, 0.1, 0), "steps"),
    ],
)
def test_step_record_validation(args, match):
    with pytest.raises(ValueError, match=match):
        StepRecord(*args)


def test_epsilon_spent_validation():
    with pytest.raises(ValueError, match="delta"):
        epsilon_spent([StepRecord(1.0, 0.1, 1)], delta=1.0)
    with pytest.raises(ValueError, match="StepRecord"):
        epsilon_spent([(1.0, 0.1, 1)], delta=DELTA)  # type: ignore[list-item]
