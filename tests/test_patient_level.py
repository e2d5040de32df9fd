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


# ---------------------------------------------------------------------------
# config and data: the unit, the cap, patient ids
# ---------------------------------------------------------------------------


def test_config_unit_and_cap_are_validated():
    from shared.config import ConfigError, config_from_dict

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

    from shared.data.records import PoseRecord

    return [PoseRecord(f"/x/{i:04d}.png", (10.0, 10.0), 1.0, np.zeros((16, 2)), np.zeros(16, bool), patient=p)
            for i, p in enumerate(patients)]


def test_patient_groups_keep_a_fixed_subset_beyond_the_cap():
    from shared.data.patients import group_by_patient, largest_group

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

    from federation_support import prepare_world, world_root
    from shared.data.mpii import load_split
    from shared.data.patients import largest_group

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
