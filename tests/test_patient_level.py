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
    from fedpose.shared.privacy.accounting.group import group_privacy

    eps_k, delta_k = group_privacy(epsilon=epsilon, delta=delta, k=k)
    want_eps, want_delta = _group_by_induction(epsilon, delta, k)
    assert eps_k == pytest.approx(want_eps, rel=1e-12)
    assert delta_k == pytest.approx(want_delta, rel=1e-12)
    assert delta_k <= k * math.exp((k - 1) * epsilon) * delta * (1 + 1e-12)  # the k e^((k-1) eps) delta form


def test_group_privacy_at_the_issue_example_and_validation():
    from fedpose.shared.privacy.accounting.group import group_privacy

    eps_k, delta_k = group_privacy(epsilon=0.8, delta=1e-5, k=8)
    assert eps_k == pytest.approx(6.4)
    assert 4.8e-3 < delta_k < 5.0e-3  # 1e-5 (e^6.4 - 1) / (e^0.8 - 1)
    for bad in ({"k": 0}, {"k": 2.5}, {"k": True}, {"epsilon": -1.0}, {"delta": 1.0}):
        with pytest.raises(ValueError):
            group_privacy(**{"epsilon": 0.8, "delta": 1e-5, "k": 8, **bad})


def test_group_privacy_at_a_large_epsilon_does_not_overflow():
    """A diagnostic run at eps 1000 trained for minutes and then crashed writing its metrics: e^(k eps) overflowed.
    The pair is computed in log space where it must be; a delta past float range is inf (>= 1: no guarantee)."""
    from fedpose.shared.privacy.accounting.group import group_privacy

    assert group_privacy(epsilon=1000.0, delta=1e-5, k=1) == (1000.0, 1e-5)
    eps_k, delta_k = group_privacy(epsilon=300.0, delta=1e-5, k=3)  # 1e-5 (e^900 - 1) / (e^300 - 1) ~ 1e-5 e^600
    assert eps_k == 900.0 and delta_k == pytest.approx(math.exp(600.0 + math.log(1e-5)), rel=1e-9)
    assert group_privacy(epsilon=1000.0, delta=1e-5, k=3) == (3000.0, math.inf)
    assert group_privacy(epsilon=1000.0, delta=0.0, k=3) == (3000.0, 0.0)


# ---------------------------------------------------------------------------
# config and data: the unit, the cap, patient ids
# ---------------------------------------------------------------------------


def test_config_unit_and_cap_are_validated():
    from fedpose.shared.errors import ConfigError
    from fedpose.shared.configuration.schema import config_from_dict

    cfg = config_from_dict({})
    assert cfg.privacy.unit == "record" and cfg.privacy.max_records_per_patient is None
    cfg = config_from_dict({"privacy": {"unit": "patient", "max_records_per_patient": 4}})
    assert (cfg.privacy.unit, cfg.privacy.max_records_per_patient) == ("patient", 4)
    with pytest.raises(ConfigError, match=r"privacy\.unit"):
        config_from_dict({"privacy": {"unit": "frame"}})
    with pytest.raises(ConfigError, match=r"max_records_per_patient"):
        config_from_dict({"privacy": {"max_records_per_patient": 0}})


def _records(patients: list[str | None]):
    import numpy as np

    from fedpose.shared.data.records import PoseRecord

    return [PoseRecord(f"/x/{i:04d}.png", (10.0, 10.0), 1.0, np.zeros((16, 2)), np.zeros(16, bool), patient=p)
            for i, p in enumerate(patients)]


def test_patient_groups_keep_a_fixed_subset_beyond_the_cap():
    from fedpose.shared.data.patients import group_by_patient, largest_group

    records = _records(["a"] * 5 + ["b"] * 2 + ["c"] * 9)
    assert largest_group(records) == 9
    kept, groups = group_by_patient(records, cap=None)
    assert len(kept) == 16 and groups.sizes == (5, 2, 9) and groups.largest == 9
    kept, groups = group_by_patient(records, cap=3, seed=0)
    assert groups.sizes == (3, 2, 3) and groups.largest == 9 and len(kept) == 8
    # members index the kept records, patient by patient; every patient's members are its own
    for members, patient in zip(groups.members, ("a", "b", "c")):
        assert {kept[i].patient for i in members} == {patient}
    again, _ = group_by_patient(records, cap=3, seed=0)
    assert [r.image for r in again] == [r.image for r in kept]  # deterministic per seed
    other = {tuple(r.image for r in group_by_patient(records, cap=3, seed=s)[0]) for s in range(6)}
    assert len(other) > 1  # another seed keeps another subset
    with pytest.raises(ValueError, match="no patient id"):
        group_by_patient(_records(["a", None]), cap=None)
    assert largest_group(_records([None, None])) is None


def test_the_ward_carries_patient_ids_and_mpii_without_a_sidecar_has_none(tmp_path_factory, tmp_path):
    import json
    import shutil
    from pathlib import Path

    from support.federation import prepare_world, world_root
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.data.patients import largest_group

    cfg = prepare_world(world_root(tmp_path_factory))
    records = load_split(Path(cfg.data.root), "site-0")
    ids = json.loads((Path(cfg.data.root) / "site-0" / "identities.json").read_text())
    assert [r.patient for r in records] == ids
    assert largest_group(records) == cfg.data.synth.images_per_identity
    # an MPII-layout split without a sidecar: no patient ids
    copy = tmp_path / "mpii" / "train"
    shutil.copytree(Path(cfg.data.root) / "site-0", copy)
    (copy / "identities.json").unlink()
    assert all(r.patient is None for r in load_split(tmp_path / "mpii", "train"))
    # a patients.json sidecar (real data) wins; a misaligned one is refused
    (copy / "patients.json").write_text(json.dumps([f"p{i // 2}" for i in range(len(records))]))
    assert largest_group(load_split(tmp_path / "mpii", "train")) == 2
    (copy / "patients.json").write_text(json.dumps(["p0"]))
    with pytest.raises(ValueError, match="patients.json"):
        load_split(tmp_path / "mpii", "train")


# ---------------------------------------------------------------------------
# the patient-level step: per-patient clipping inside the FP-DP step
# ---------------------------------------------------------------------------


def _patient_loop(loss_fn, params, batch, groups, clip):
    """Reference: per patient, the model on that patient's records, autograd of their mean loss, clip, sum."""
    import torch

    from fedpose.shared.privacy.step.subspace import flat_vector

    total = None
    for patient in sorted(set(groups.tolist())):
        rows = (groups == patient).nonzero().flatten()
        leaves = {n: p.clone().requires_grad_(True) for n, p in params.items()}
        loss = loss_fn(leaves, {k: v[rows] for k, v in batch.items()}).mean()
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        flat = flat_vector(grads)
        clipped = flat * min(1.0, clip / (float(flat.norm()) + 1e-6))
        total = clipped if total is None else total + clipped
    return total


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 64])
def test_per_patient_clipping_matches_a_per_patient_loop(toy_pose, chunk_size):
    """clip(mean of a patient's per-record gradients, C), summed over patients; groups may span chunks."""
    import torch

    from fedpose.shared.privacy.step.fpdp import clipped_group_sum
    from fedpose.shared.privacy.step.subspace import flat_vector
    from support.toy import make_batch

    loss_fn, params = toy_pose
    batch = make_batch(11, seed=3)
    groups = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 2, 3, 3])  # 4 patients with 3, 1, 5, 2 records
    loop = _patient_loop(loss_fn, params, batch, groups, clip=1e9)  # unclipped: the per-patient means
    norms_ref = []
    for patient in range(4):
        one = _patient_loop(loss_fn, params, {k: v[groups == patient] for k, v in batch.items()},
                            groups[groups == patient], clip=1e9)
        norms_ref.append(float(one.norm()))
    clip = sorted(norms_ref)[1] * 1.01  # some patients clipped, some not
    want = _patient_loop(loss_fn, params, batch, groups, clip=clip)
    summed, norms, _ = clipped_group_sum(loss_fn, params, batch, groups=groups, clip_norm=clip, chunk_size=chunk_size)
    torch.testing.assert_close(flat_vector(summed), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms, torch.tensor(norms_ref, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(want, loop)  # clipping did something
    # one record per patient is the record-level clipped sum
    from fedpose.shared.privacy.step.fpdp import clipped_grad_sum

    per_record, _, _ = clipped_grad_sum(loss_fn, params, batch, clip_norm=clip, chunk_size=4)
    singles, _, _ = clipped_group_sum(loss_fn, params, batch, groups=torch.arange(11), clip_norm=clip, chunk_size=4)
    torch.testing.assert_close(flat_vector(singles), flat_vector(per_record), rtol=1e-5, atol=1e-6)


def test_group_ids_must_be_contiguous_and_match_the_batch(toy_pose):
    import torch

    from fedpose.shared.privacy.step.fpdp import clipped_group_sum
    from support.toy import make_batch

    loss_fn, params = toy_pose
    batch = make_batch(4)
    for bad in (torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 1]), torch.tensor([[0, 0, 1, 1]])):
        with pytest.raises(ValueError, match="groups"):
            clipped_group_sum(loss_fn, params, batch, groups=bad, clip_norm=1.0, chunk_size=2)
    summed, norms, _ = clipped_group_sum(loss_fn, params, make_batch(0), groups=torch.zeros(0, dtype=torch.long),
                                      clip_norm=1.0, chunk_size=2)
    assert norms.shape == (0,) and not any(v.any() for v in summed.values())


def test_patient_step_adds_one_noise_draw_and_divides_by_the_expected_patients(toy_pose):
    """g = (sum_patients clip(mean g_i, C) + N(0, sigma^2 C^2)) / B (the declared expected patients), then V V^T g."""
    import torch

    from fedpose.shared.privacy.step.fpdp import DPSpec, dp_gradient, clipped_group_sum
    from fedpose.shared.privacy.step.noise import gaussian_noise_like, make_generator
    from fedpose.shared.privacy.step.subspace import flat_vector
    from support.toy import make_batch

    loss_fn, params = toy_pose
    batch = make_batch(6, seed=4)
    groups = torch.tensor([0, 0, 1, 1, 1, 2])
    spec = DPSpec(method="dpsgd", clip_norm=0.5, sigma=1.3, sample_rate=0.25, expected_batch=3.0, unit="patient")
    assert spec.expected_batch == pytest.approx(3.0)  # q_p x patients, declared
    got, info = dp_gradient(loss_fn, params, spec=spec, private_batch=batch, groups=groups, psi_batch=None,
                            generator=make_generator(8, "cpu")[0], basis=None)
    summed, _, _ = clipped_group_sum(loss_fn, params, batch, groups=groups, clip_norm=0.5, chunk_size=16)
    noise = gaussian_noise_like(summed, std=1.3 * 0.5, generator=make_generator(8, "cpu")[0])
    torch.testing.assert_close(flat_vector(got), (flat_vector(summed) + flat_vector(noise)) / 3.0, rtol=1e-5, atol=1e-6)
    assert info["batch_size"] == 3 and info["unit"] == "patient"  # patients, not records
    with pytest.raises(ValueError, match="groups"):
        dp_gradient(loss_fn, params, spec=spec, private_batch=batch, psi_batch=None,
                    generator=make_generator(8, "cpu")[0], basis=None)
    record = DPSpec(method="dpsgd", clip_norm=0.5, sigma=1.3, sample_rate=0.25, expected_batch=3.0)
    with pytest.raises(ValueError, match="groups"):
        dp_gradient(loss_fn, params, spec=record, private_batch=batch, groups=groups, psi_batch=None,
                    generator=make_generator(8, "cpu")[0], basis=None)
    with pytest.raises(ValueError, match="unit"):
        DPSpec(method="dpsgd", clip_norm=0.5, sigma=1.3, sample_rate=0.25, expected_batch=3.0, unit="frame")


# ---------------------------------------------------------------------------
# claims: both units name the unit; record-level claims give the group bound
# ---------------------------------------------------------------------------


def test_record_level_claims_state_the_group_bound_for_a_patient():
    from fedpose.shared.privacy.accounting.claims import privacy_claim
    from fedpose.shared.privacy.accounting.group import group_privacy

    eps_k, delta_k = group_privacy(epsilon=0.8, delta=1e-5, k=8)
    for method, level in (("dpsgd", "record-level (eps=0.8, delta=1e-05)-DP"), ("fpdp", "-Feature-DP")):
        text = privacy_claim(method=method, epsilon=0.8, delta=1e-5, psi="blur(0.03)", seeded=False,
                             accountant="rdp", unit="record", records_per_patient=8,
                             records_source="this data's patient ids")
        assert level in text and "add/remove-one-record" in text
        assert "a patient with up to 8 records (this data's patient ids)" in text
        assert f"(eps={eps_k:.4g}, delta={delta_k:.3g})" in text and "group privacy" in text
    vacuous = privacy_claim(method="dpsgd", epsilon=3.0, delta=1e-5, psi=None, seeded=False, accountant="rdp",
                            records_per_patient=20, records_source="the policy cap")
    assert "no guarantee" in vacuous
    unknown = privacy_claim(method="dpsgd", epsilon=0.8, delta=1e-5, psi=None, seeded=False, accountant="rdp")
    assert "record-level" in unknown and "no cap on records per patient" in unknown and "k eps" in unknown


def test_patient_level_claims_name_the_unit():
    from fedpose.shared.privacy.accounting.claims import privacy_claim

    text = privacy_claim(method="dpsgd", epsilon=0.8, delta=1e-5, psi=None, seeded=False, accountant="rdp",
                         unit="patient", records_per_patient=8)
    assert text.startswith("patient-level (eps=0.8, delta=1e-05)-DP per site")
    assert "add/remove-one-patient" in text and "at most 8 of their records" in text and "group" not in text
    feature = privacy_claim(method="fpdp", epsilon=0.8, delta=1e-5, psi="blur(0.03)", seeded=False,
                            accountant="rdp", unit="patient", records_per_patient=None)
    assert "Feature-DP at patient level" in feature and "every image of a patient" in feature
    assert "not patient-level DP" in feature and "all of their records" in feature
    with pytest.raises(ValueError, match="unit"):
        privacy_claim(method="dpsgd", epsilon=0.8, delta=1e-5, psi=None, seeded=False, accountant="rdp",
                      unit="frame")


# ---------------------------------------------------------------------------
# the training loop and the centralized run
# ---------------------------------------------------------------------------


@pytest.mark.invariant("P4")
def test_local_train_samples_patients_at_q_p_and_hands_the_step_their_groups(world, monkeypatch):
    """P4 at patient level: Poisson over patients with the q the result reports (the accountant's input)."""
    import torch

    import fedpose.shared.training.loop as step_module
    import fedpose.shared.training.batches as batches
    import fedpose.shared.training.loop as train_module
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.data.patients import group_by_patient
    from fedpose.shared.privacy.step.noise import make_generator
    from fedpose.shared.training.runs import initial_model

    cfg = replace(world, **{"train.method": "dpsgd", "train.batch_size": 2, "privacy.unit": "patient",
                            "privacy.max_records_per_patient": 3})
    kept, groups = group_by_patient(load_split(cfg.data.root, "site-0"), cap=3)
    assert groups.count == 5 and set(groups.sizes) == {3}
    dataset = batches.make_dataset(kept, cfg, train=True, seed=0)
    draws, steps_seen = [], []
    real_sample, real_step = step_module.poisson_sample, step_module.dp_gradient

    def sample(n, *, sample_rate, generator):
        out = real_sample(n, sample_rate=sample_rate, generator=generator)
        draws.append((n, sample_rate, out.tolist()))
        return out

    def step(loss_fn, params, *, spec, private_batch, groups=None, **kwargs):
        steps_seen.append((spec, private_batch["image"].shape[0], groups))
        return real_step(loss_fn, params, spec=spec, private_batch=private_batch, groups=groups, **kwargs)

    monkeypatch.setattr(step_module, "poisson_sample", sample)
    monkeypatch.setattr(step_module, "dp_gradient", step)
    local_data = train_module.LocalData(dataset, patients=groups)
    local_run = train_module.LocalRun(train_module.step_spec("dpsgd", cfg.train, cfg.privacy, sigma=1.0,
                                      data=local_data), 4, cfg.train, cfg.privacy)
    result = train_module.local_train(initial_model(cfg, progress=False), local_data, local_run,
                                      generator=make_generator(0)[0], bar=None)
    assert (result.unit, result.n, result.sample_rate) == ("patient", 5, pytest.approx(2 / 5))
    assert [(n, q) for n, q, _ in draws] == [(5, pytest.approx(0.4))] * 4
    for (_, _, sampled), (spec, records, step_groups) in zip(draws, steps_seen):
        assert spec.unit == "patient" and spec.expected_batch == 2.0 and spec.sample_rate == pytest.approx(0.4)
        assert records == 3 * len(sampled)  # every record (up to the cap) of every sampled patient
        want = [j for j in range(len(sampled)) for _ in range(3)]
        assert step_groups.tolist() == want and step_groups.dtype == torch.long
    with pytest.raises(ValueError, match="patient"):  # patient unit without groups
        local_data = train_module.LocalData(dataset)
        local_run = train_module.LocalRun(train_module.step_spec("dpsgd", cfg.train, cfg.privacy, sigma=1.0,
                                          data=local_data), 1, cfg.train, cfg.privacy)
        train_module.local_train(initial_model(cfg, progress=False), local_data, local_run,
                                 generator=make_generator(0)[0], bar=None)


def test_fedpose_train_unit_patient_accounts_at_q_p_and_claims_patient_level(world, tmp_path):
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.privacy.accounting.accountant import StepRecord, epsilon_spent
    from fedpose.shared.training.runs import run_train

    cfg = replace(world, **{"train.method": "fpdp", "train.epochs": 1, "train.batch_size": 4,
                            "privacy.unit": "patient", "privacy.max_records_per_patient": 4})
    metrics = run_train(cfg, tmp_path / "run", progress=False)
    patients = 10  # two sites of 40 images, 8 per identity
    assert metrics["unit"] == "patient" and metrics["sample_rate"] == pytest.approx(4 / patients)
    assert metrics["steps"] == 3  # ceil(10 patients / 4) per epoch
    ran = StepRecord(sigma=metrics["sigma"], sample_rate=4 / patients, steps=3)
    assert metrics["epsilon"] == pytest.approx(epsilon_spent([ran], delta=cfg.privacy.delta))
    assert metrics["epsilon"] <= cfg.privacy.epsilon
    assert "Feature-DP at patient level" in metrics["claim"] and "at most 4 of their records" in metrics["claim"]
    assert metrics["max_records_per_patient"] == 4


def test_fedpose_train_record_level_states_the_group_bound_from_the_data(world, tmp_path):
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.privacy.accounting.group import group_privacy
    from fedpose.shared.training.runs import run_train

    cfg = replace(world, **{"train.method": "dpsgd", "train.epochs": 1, "privacy.epsilon": 0.5})
    metrics = run_train(cfg, tmp_path / "run", progress=False)
    assert metrics["unit"] == "record" and metrics["max_records_per_patient"] == 8
    eps_k, delta_k = group_privacy(epsilon=metrics["epsilon"], delta=cfg.privacy.delta, k=8)
    assert metrics["group_epsilon"] == pytest.approx(eps_k) and metrics["group_delta"] == pytest.approx(delta_k)
    assert "a patient with up to 8 records (the most any patient has in this data" in metrics["claim"]
    assert f"eps={eps_k:.4g}" in metrics["claim"]
    # a stated cap below what the data holds is refused; one above it is used as stated
    with pytest.raises(ValueError, match="max_records_per_patient"):
        run_train(replace(cfg, **{"privacy.max_records_per_patient": 4}), tmp_path / "r2", progress=False)
    capped = run_train(replace(cfg, **{"privacy.max_records_per_patient": 10}), tmp_path / "r3", progress=False)
    assert capped["max_records_per_patient"] == 10 and "up to 10 records" in capped["claim"]


# ---------------------------------------------------------------------------
# the site enforces its unit (P11) and records it (P12)
# ---------------------------------------------------------------------------


def _patient_policy(cfg, tmp_path, **overrides):
    from support.site import site_policy

    return site_policy(cfg, tmp_path, **{"unit": "patient", "sample_rate": 0.4, "max_records_per_patient": 6,
                                     **overrides})


def _unit_request(cfg, state, *, unit: str, sigma: float, sample_rate: float, round: int = 1):
    from fedpose.shared.configuration.schema import replace
    from support.site import train_request

    return train_request(replace(cfg, **{"privacy.unit": unit}), state, sigma=sigma, sample_rate=sample_rate,
                    round=round)


@pytest.mark.invariant("P11", "P12")
def test_a_patient_level_site_refuses_record_level_requests_and_records_its_unit(world_weights, tmp_path):
    from fedpose.client.policy import min_sigma_for
    from fedpose.client.site import handle_train
    from fedpose.client.data import site_info
    from fedpose.shared.flower.messages import METRICS, RefusalCode
    from support.site import site_policy, q_of, refusal_of, spend_rows

    cfg, state = world_weights
    policy = _patient_policy(cfg, tmp_path)
    sigma = min_sigma_for(policy)
    info = site_info(policy)
    assert (info.unit, info.max_records_per_patient, info.sample_rate) == ("patient", 6, 0.4)
    refusal = refusal_of(_unit_request(cfg, state, unit="record", sigma=sigma, sample_rate=0.4), policy)
    assert refusal.code == RefusalCode.POLICY and "unit" in refusal.reason
    assert spend_rows(policy) == []  # nothing trained, nothing spent
    reply = handle_train(_unit_request(cfg, state, unit="patient", sigma=sigma, sample_rate=0.4), policy)
    assert reply[METRICS]["sample-rate"] == 0.4  # q_p, the policy's, what the accountant gets
    (row,) = spend_rows(policy)
    assert (row["unit"], row["sample_rate"], row["method"]) == ("patient", 0.4, "dpsgd")
    # and a record-level site refuses a patient-level request (its q is over records)
    record = site_policy(cfg, tmp_path / "record")
    refusal = refusal_of(_unit_request(cfg, state, unit="patient", sigma=min_sigma_for(record), sample_rate=q_of(cfg)),
                       record)
    assert refusal.code == RefusalCode.POLICY and spend_rows(record) == []
    assert site_info(record).unit == "record" and site_info(record).max_records_per_patient is None


def test_the_site_checks_its_cap_and_its_patient_ids(world_weights, tmp_path):
    import shutil
    from pathlib import Path

    from fedpose.client.data import check_site, load_split_dir
    from support.site import site_policy

    cfg, _ = world_weights
    # 8 images per identity, a stated cap of 4: the records beyond it are left out locally, with an alert (an
    # answer that changed with the data would tell the server when a patient passed the cap, P13)
    capped = check_site(site_policy(cfg, tmp_path, max_records_per_patient=4, prepare=False))
    assert len(capped.private) == 20 and capped.patients is None
    assert any("more than max_records_per_patient=4" in alert for alert in capped.alerts)
    record_level = site_policy(cfg, tmp_path, max_records_per_patient=8, prepare=False)
    assert check_site(record_level).patients is None  # record level
    checked = check_site(_patient_policy(cfg, tmp_path, max_records_per_patient=3, prepare=False))
    assert checked.patients.count == 5 and len(checked.private) == 15  # a fixed 3 of each patient's 8
    # delta < 1 / n is checked against the number of the unit that is sampled: 5 patients, 40 records
    assert check_site(_patient_policy(cfg, tmp_path, delta=0.1, prepare=False)).patients.count == 5
    with pytest.raises(ValueError, match="delta"):
        check_site(site_policy(cfg, tmp_path, delta=0.1, prepare=False))
    with pytest.raises(ValueError, match="delta"):
        check_site(_patient_policy(cfg, tmp_path, delta=0.25, prepare=False))
    # data without patient ids (MPII-like): record level only
    copy = tmp_path / "no-ids" / "site-0"
    shutil.copytree(Path(cfg.data.root) / "site-0", copy)
    (copy / "identities.json").unlink()
    assert len(load_split_dir(copy, "site data")) == 40
    with pytest.raises(ValueError, match="no patient id"):
        check_site(_patient_policy(cfg, tmp_path, data_path=str(copy), prepare=False))
    no_ids = check_site(site_policy(cfg, tmp_path, data_path=str(copy), max_records_per_patient=2, prepare=False))
    assert no_ids.patients is None and len(no_ids.private) == 40  # nothing to check the cap against


def test_policy_unit_defaults_to_record_and_round_trips(world_weights, tmp_path):
    from fedpose.client.policy import load_policy, policy_from_dict, policy_to_dict, write_policy

    cfg, _ = world_weights
    policy = _patient_policy(cfg, tmp_path)
    assert load_policy(write_policy(tmp_path / "p.yaml", policy)) == policy
    old = {k: v for k, v in policy_to_dict(policy).items() if k not in ("unit", "max_records_per_patient")}
    assert policy_from_dict(old).unit == "record"  # a policy that names no unit is record level
    for bad, match in (({"unit": "frame"}, "unit"), ({"max_records_per_patient": 0}, "max_records_per_patient"),
                       ({"max_records_per_patient": 2.5}, "max_records_per_patient")):
        with pytest.raises(ValueError, match=match):
            policy_from_dict({**old, **bad})


def test_site_ledger_schema_3_records_the_unit_and_migrates_schema_2(tmp_path):
    import sqlite3

    from fedpose.client.ledger import SCHEMA_VERSION, Mechanism, SiteLedger

    old = tmp_path / "v2.sqlite"
    with SiteLedger(old, site="site-0") as ledger, ledger.round() as open_round:
        open_round.record(site="site-0", federation="f", round=1, sigma=2.0, sample_rate=0.2, steps=2, delta=1e-3,
                          budget=10.0, accountant="rdp",
                          mechanism=Mechanism(method="dpsgd", psi=None, clip_norm=1.0, augment=True))
    # make it a schema-2 file: drop the unit column
    conn = sqlite3.connect(old)
    for column in ("unit", "state", "noise_seed", "data_version", "request_digest", "outcome",
                   "attempts"):  # schemas 3 to 6
        conn.execute(f"ALTER TABLE spend DROP COLUMN {column}")
    conn.execute("PRAGMA user_version = 2")
    conn.commit()
    conn.close()
    with SiteLedger(old, site="site-0") as ledger:
        assert [r["unit"] for r in ledger.rows()] == ["record"]  # everything before issue #11 was record level
        with ledger.round() as open_round:
            open_round.record(site="site-0", federation="f", round=2, sigma=2.0, sample_rate=0.2, steps=2,
                              delta=1e-3, budget=10.0, accountant="rdp",
                              mechanism=Mechanism(method="dpsgd", psi=None, clip_norm=1.0, augment=True,
                                                  unit="patient"))
        assert [r["unit"] for r in ledger.rows()] == ["record", "patient"]
        assert ledger.units() == {"record", "patient"}
    conn = sqlite3.connect(old)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.close()


def test_site_info_carries_the_unit_and_the_server_leaves_out_a_site_of_another_unit():
    from flwr.app import ConfigRecord

    from fedpose.server.plan import incompatibility
    from fedpose.shared.configuration.schema import config_from_dict
    from fedpose.shared.flower.messages import SiteInfo

    info = SiteInfo(site="a", epsilon=1.0, delta=1e-5, lifetime_rounds=5, rounds_per_federation=5, rounds_done=0,
                    epsilon_spent=0.0, min_sigma=1.0, sample_rate=0.4, steps_per_round=10, clip_norm=1.0, psi="blur",
                    psi_min=0.03, augment=True, accountant="rdp", methods=("fpdp",), unit="patient",
                    max_records_per_patient=8)
    assert SiteInfo.from_record(info.to_record()) == info
    older = {k: v for k, v in dict(info.to_record()).items() if k not in ("unit", "max-records-per-patient")}
    parsed = SiteInfo.from_record(ConfigRecord(older))  # a site of before issue #11: record level, no cap
    assert (parsed.unit, parsed.max_records_per_patient) == ("record", None)
    with pytest.raises(ValueError, match="unit"):
        SiteInfo.from_record(ConfigRecord({**dict(info.to_record()), "unit": "frame"}))
    cfg = config_from_dict({"privacy": {"clip_norm": 1.0, "psi_param": 0.03}, "data": {"input_size": [64, 64]}})
    assert "unit" in incompatibility(info, cfg)
    patient = config_from_dict({"privacy": {"clip_norm": 1.0, "psi_param": 0.03, "unit": "patient"},
                                "data": {"input_size": [64, 64]}})
    assert incompatibility(info, patient) is None


# ---------------------------------------------------------------------------
# a federation of patient-level sites, end to end (in process)
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_federation_of_patient_level_sites_runs_end_to_end(world, tmp_path):
    import json

    from fedpose.cli.local_federation import prepare_simulation
    from fedpose.client.ledger import SiteLedger
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.privacy.accounting.accountant import epsilon_spent

    from fedpose.server.run import run_federation

    cfg = replace(world, **{"privacy.unit": "patient", "privacy.max_records_per_patient": 4,
                            "train.batch_size": 2, "train.method": "fpdp", "federation.basis_mode": "site",
                            "federation.out": str(tmp_path / "fed")})
    out = tmp_path / "fed"
    config_path = prepare_simulation(cfg, out, progress=False)  # writes each site's default policy
    run_config = {"config": str(config_path), "overrides": "", "out": str(out), "resume": False}
    from support.federation import InProcessGrid

    metrics = run_federation(InProcessGrid(run_config, sites=2), cfg, out)

    assert metrics["rounds"] == 2 and metrics["unit"] == "patient"
    assert metrics["claim"].startswith("(eps=") and "Feature-DP at patient level" in metrics["claim"]
    assert "add/remove-one-patient" in metrics["claim"] and "at most 4 of their records" in metrics["claim"]
    for site in ("site-0", "site-1"):
        policy_text = (out / "sites" / site / "policy.yaml").read_text()
        assert "unit: patient" in policy_text and "max_records_per_patient: 4" in policy_text
        assert metrics["sites"][site]["sample_rate"] == pytest.approx(2 / 5)  # q_p: 2 of 5 patients per step
        with SiteLedger(out / "sites" / site / "ledger.sqlite") as ledger:
            rows = ledger.rows()
            assert [r["unit"] for r in rows] == ["patient", "patient"]
            fresh = epsilon_spent(ledger.history(), delta=cfg.privacy.delta)
        assert rows[-1]["epsilon"] == pytest.approx(fresh, rel=1e-9)
        assert metrics["sites"][site]["epsilon"] == pytest.approx(fresh, rel=1e-9)
        assert fresh <= cfg.privacy.epsilon
    assert json.loads((out / "metrics.json").read_text())["unit"] == "patient"


# ---------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------


def test_cli_train_unit_patient_and_site_policy_unit_patient(world, tmp_path, capsys):
    from pathlib import Path

    import yaml

    from fedpose.cli.main import main
    from fedpose.client.policy import load_policy
    from fedpose.shared.configuration.schema import dump_config

    config = tmp_path / "cfg.yaml"
    dump_config(world, config)
    assert main(["train", "--config", str(config), "--method", "dpsgd", "--unit", "patient",
                 "--max-records-per-patient", "4", "--epochs", "1", "--out", str(tmp_path / "run"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "unit = patient" in out and "claim: patient-level" in out and "add/remove-one-patient" in out

    root = Path(world.data.root)
    policy = tmp_path / "site" / "policy.yaml"
    assert main(["site-policy", "--out", str(policy), "--site", "hospital-a", "--epsilon", "1", "--delta", "1e-3",
                 "--lifetime-rounds", "4", "--sample-rate", "0.4", "--expected-batch", "2", "--steps-per-round", "2",
                 "--data-path", str(root / "site-0"), "--unit", "patient", "--max-records-per-patient", "6"]) == 0
    out = capsys.readouterr().out
    assert "unit: patient (5 patients" in out and "at most 6" in out
    written = yaml.safe_load(policy.read_text())
    assert (written["unit"], written["max_records_per_patient"]) == ("patient", 6)
    assert load_policy(policy).unit == "patient"
    assert main(["site-policy", "--check", str(policy)]) == 0
    # a record-level policy whose stated cap is below what the data holds: the records beyond it are left out,
    # and the operator is told (q defaults to B / n, computed from the data here)
    assert main(["site-policy", "--out", str(tmp_path / "r.yaml"), "--site", "b", "--epsilon", "1", "--delta", "1e-3",
                 "--lifetime-rounds", "4", "--expected-batch", "8", "--steps-per-round", "2",
                 "--data-path", str(root / "site-0"), "--max-records-per-patient", "3"]) == 0
    out = capsys.readouterr().out
    assert "alert: 25 record(s) of patients with more than max_records_per_patient=3" in out
    assert load_policy(tmp_path / "r.yaml").sample_rate == 0.2  # 8 / 40


@pytest.mark.slow
def test_a_record_level_federation_claims_the_group_bound_at_the_sites_caps(world, tmp_path):
    from fedpose.cli.local_federation import prepare_simulation
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.privacy.accounting.group import group_privacy

    from fedpose.server.run import run_federation

    cfg = replace(world, **{"train.method": "dpsgd", "federation.rounds": 1, "privacy.epsilon": 0.5,
                            "federation.out": str(tmp_path / "fed")})
    out = tmp_path / "fed"
    config_path = prepare_simulation(cfg, out, progress=False)  # record level: each policy states its split's 8
    run_config = {"config": str(config_path), "overrides": "", "out": str(out), "resume": False}
    from support.federation import InProcessGrid

    metrics = run_federation(InProcessGrid(run_config, sites=2), cfg, out)
    assert metrics["unit"] == "record" and metrics["claim"].startswith("record-level")
    eps_k, delta_k = group_privacy(epsilon=metrics["epsilon"], delta=metrics["delta"], k=8)
    assert "a patient with up to 8 records (the largest cap the sites' policies state)" in metrics["claim"]
    assert f"(eps={eps_k:.4g}, delta={delta_k:.3g})-DP by group privacy" in metrics["claim"]
