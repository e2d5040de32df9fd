"""Membership inference: ROC arithmetic, LiRA on synthetic statistics, and a tiny end-to-end run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedpose.shared.configuration.schema import config_from_dict
from fedpose.shared.experiments.membership import (
    MiaSpec,
    attack_scores,
    evaluate_attacks,
    roc_curve,
    roc_summary,
    run_mia,
)


def test_roc_and_auc_on_hand_computed_cases():
    members = np.array([True, False, True, False])
    # scores 4 (in), 3 (out), 2 (in), 1 (out): thresholds give (fpr, tpr) = (0,.5) (.5,.5) (.5,1) (1,1)
    fpr, tpr = roc_curve(np.array([4.0, 3.0, 2.0, 1.0]), members)
    assert fpr.tolist() == [0, 0, 0.5, 0.5, 1] and tpr.tolist() == [0, 0.5, 0.5, 1, 1]
    # AUC = P[score_in > score_out] = 3 of the 4 (in, out) pairs
    assert roc_summary(np.array([4.0, 3.0, 2.0, 1.0]), members)["auc"] == pytest.approx(0.75)
    assert roc_summary(np.array([1.0, 0.0, 1.0, 0.0]), members)["auc"] == 1.0
    assert roc_summary(np.array([0.0, 1.0, 0.0, 1.0]), members)["auc"] == 0.0
    # ties count one half, as in the Mann-Whitney statistic
    assert roc_summary(np.zeros(4), members)["auc"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="both"):
        roc_curve(np.zeros(3), np.array([True, True, True]))


def test_tpr_at_low_fpr_is_the_best_point_not_above_it():
    rng = np.random.default_rng(0)
    members = np.r_[np.ones(1000, bool), np.zeros(1000, bool)]
    scores = np.r_[rng.normal(3, 1, 1000), rng.normal(0, 1, 1000)]
    res = roc_summary(scores, members)
    # threshold at the 99th percentile of N(0,1) = 2.326: TPR = P[N(3,1) > 2.326] = 0.75
    assert res["tpr@0.01fpr"] == pytest.approx(0.75, abs=0.06)
    assert res["auc"] == pytest.approx(0.983, abs=0.01)  # Phi(3 / sqrt 2)


def test_lira_finds_members_when_in_models_fit_them_better():
    rng = np.random.default_rng(1)
    k, n = 16, 400
    members = rng.random((k, n)) < 0.5
    difficulty = rng.normal(0, 2, n)  # per-record loss level: hides membership from the plain loss attack
    loss = difficulty + np.where(members, -1.0, 0.0) + rng.normal(0, 0.3, (k, n))
    conf = -loss
    res = evaluate_attacks(loss, conf, members)
    assert res["lira_online"]["auc"] > 0.9 and res["lira_offline"]["auc"] > 0.85
    assert res["loss"]["auc"] < 0.7  # the per-record difficulty swamps a global threshold
    null = evaluate_attacks(difficulty + rng.normal(0, 0.3, (k, n)), conf, members)
    assert abs(null["lira_online"]["auc"] - 0.5) < 0.05
    assert set(attack_scores(loss, conf, members, 0)) == {"loss", "confidence", "lira_online", "lira_offline"}


@pytest.mark.slow
def test_mia_end_to_end_on_a_tiny_ward(tmp_path):
    cfg = config_from_dict({
        "data": {"source": "synthetic", "root": str(tmp_path / "ward"),
                 "synth": {"sites": 1, "per_site": 24, "public": 24, "val": 8, "seed": 2, "image_size": 64},
                 "train_splits": ["site-0"], "input_size": [32, 32]},
        "model": {"joint_channels": 4, "hidden": 32},
        "pretrain": {"out": str(tmp_path / "pre"), "epochs": 1, "batch_size": 16},
        "privacy": {"k": 4, "m": 12, "basis_every": 4, "chunk_size": 16, "delta": 1.0e-3, "epsilon": 2.0},
        "train": {"epochs": 2, "batch_size": 6, "public_batch_size": 6, "strategy": "finetune"},
    })
    res = run_mia(cfg, MiaSpec(methods=("nonprivate", "fpdp"), models=3, pool=24, seed=0), tmp_path / "out",
                  progress=False)
    for method in ("nonprivate", "fpdp"):
        attacks = res["methods"][method]["attacks"]
        assert set(attacks) == {"loss", "confidence", "lira_online", "lira_offline"}
        assert all(0.0 <= a["auc"] <= 1.0 for a in attacks.values())
    assert res["methods"]["nonprivate"]["epsilon"] is None
    assert 0 < res["methods"]["fpdp"]["epsilon"] <= 2.0
    saved = json.loads((tmp_path / "out" / "mia.json").read_text())
    assert saved["methods"]["fpdp"]["roc"]["lira_online"]["fpr"][-1] == 1.0
    assert (tmp_path / "out" / "mia.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="pool"):
        run_mia(cfg, MiaSpec(methods=("nonprivate",), models=3, pool=100), progress=False)
    with pytest.raises(ValueError, match="models"):
        MiaSpec(models=2)


@pytest.mark.slow
def test_cli_attack_mia_refuses_bad_input(tmp_path, capsys):
    from fedpose.cli.main import main

    assert main(["attack", "mia", "--methods", "nonprivate,bogus", "--out", str(tmp_path)]) == 3
    assert "methods" in capsys.readouterr().err
