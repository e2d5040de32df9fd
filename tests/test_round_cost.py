"""What a round may cost is the site's, not the server's: the policy pins the augmentation multiplicity, and with
``round_seconds`` a request whose worst case (steps x the chunks of the Poisson batch's upper tail, each timed on a
blank chunk of the request's own model before the charge) does not fit the period is refused with nothing spent.
``fedpose site check`` measures the worst case at the policy's limits (time against ``round_seconds``, peak memory
against the machine's) and refuses a policy whose worst case does not fit.

Before, a server could push rounds across a multiple of ``round_seconds`` (a larger model or multiplicity), and
then which multiple an answer left at tracked the realised batch.
"""

from __future__ import annotations

import pytest

from fedpose.client.policy import min_sigma_for, write_policy
from fedpose.client.site import handle_train
from fedpose.shared.configuration.schema import replace
from fedpose.shared.flower.messages import Refusal, RefusalCode
from support.site import refusal_of, site_policy, spend_rows, train_request


@pytest.mark.invariant("P11")
def test_the_policy_pins_the_augmentation_multiplicity(world_weights, tmp_path):
    cfg, state = world_weights
    policy = site_policy(cfg, tmp_path)
    assert policy.augment_multiplicity == 1
    asked = replace(cfg, **{"privacy.augment_multiplicity": 4})
    refusal = refusal_of(train_request(asked, state, sigma=min_sigma_for(policy)), policy)
    assert refusal.code == RefusalCode.POLICY and "augment_multiplicity" in refusal.reason
    assert spend_rows(policy) == []
    pinned = site_policy(cfg, tmp_path / "pinned", augment_multiplicity=2)
    refusal = refusal_of(train_request(cfg, state, sigma=min_sigma_for(pinned)), pinned)
    assert refusal.code == RefusalCode.POLICY and "augment_multiplicity=2" in refusal.reason
    assert spend_rows(pinned) == []
    with pytest.raises(ValueError, match="augment_multiplicity"):
        site_policy(cfg, tmp_path / "bad", augment_multiplicity=0, prepare=False)


@pytest.mark.invariant("P13")
def test_a_request_whose_worst_case_does_not_fit_round_seconds_is_refused_before_the_charge(world_weights, tmp_path):
    from fedpose.client.capacity import worst_units

    cfg, state = world_weights
    policy = site_policy(cfg, tmp_path, round_seconds=0.01)  # no round of any model fits 10 ms
    assert worst_units(policy) > policy.expected_batch  # the upper tail of the Poisson batch, from public constants
    with pytest.raises(Refusal) as refused:
        handle_train(train_request(cfg, state, sigma=min_sigma_for(policy), steps=2), policy)
    assert refused.value.code == RefusalCode.POLICY
    assert "round_seconds" in refused.value.reason and "worst case" in refused.value.reason
    assert spend_rows(policy) == []  # nothing charged, nothing trained
    roomy = site_policy(cfg, tmp_path / "roomy", round_seconds=60.0)
    handle_train(train_request(cfg, state, sigma=min_sigma_for(roomy), steps=2), roomy)
    assert [r["state"] for r in spend_rows(roomy)] == ["done"]


@pytest.mark.invariant("P13")
def test_site_check_measures_the_worst_case_and_refuses_a_policy_it_does_not_fit(world, tmp_path, capsys):
    from fedpose.cli.main import main

    small = {"max_input_size": [64, 48], "chunk_size": 4}
    policy = site_policy(world, tmp_path / "slow", prepare=False, round_seconds=0.01, **small)
    path = write_policy(tmp_path / "slow" / "policy.yaml", policy)
    assert main(["site", "check", "--policy", str(path)]) != 0
    err = capsys.readouterr().err
    assert "round_seconds=0.01" in err and "worst case" in err
    policy = site_policy(world, tmp_path / "fits", prepare=False, round_seconds=600.0, **small)
    path = write_policy(tmp_path / "fits" / "policy.yaml", policy)
    assert main(["site", "check", "--policy", str(path)]) == 0
    out = capsys.readouterr().out
    assert "worst case of a round" in out and "peak memory" in out


def test_the_measured_peak_memory_grows_with_the_chunk():
    from fedpose.client.capacity import reference_chunk_cost
    from fedpose.client.policy import policy_from_dict

    def policy(chunk: int):
        return policy_from_dict({
            "policy_version": 3, "site": "s", "epsilon": 1.0, "delta": 1e-5, "lifetime_rounds": 2,
            "rounds_per_federation": 1, "sample_rate": 0.1, "expected_batch": 4.0, "steps_per_round": 1,
            "clip_norm": 1.0, "psi": "blur", "psi_min": 0.03, "augment": False, "data_path": "d",
            "ledger_path": "l.sqlite", "chunk_size": chunk, "max_input_size": [64, 48]})

    small, large = reference_chunk_cost(policy(1)), reference_chunk_cost(policy(16))
    assert small.seconds > 0 and large.peak_bytes > small.peak_bytes > 0


@pytest.mark.invariant("P11")
def test_the_kit_and_a_simulation_pin_the_federations_multiplicity(world, tmp_path):
    """What the federation's config asks (privacy.augment_multiplicity) is what the sites' policies it writes pin:
    its own requests are not refused, another multiplicity is."""
    import yaml

    from fedpose.client.policy_resolve import default_policy
    from fedpose.server.kits.provision import Federation, provision

    cfg = replace(world, **{"privacy.augment_multiplicity": 3})
    assert default_policy(cfg, tmp_path / "sim", 0).augment_multiplicity == 3
    kits = provision(tmp_path / "kits", Federation(sites=("a",), hosts=("127.0.0.1",), port=8000), cfg)
    assert yaml.safe_load((kits["a"] / "policy.yaml").read_text())["augment_multiplicity"] == 3
