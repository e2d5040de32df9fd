"""``fedpose audit`` end to end on a tiny ward: soundness of the one-run audit and a positive control.

Soundness: the real mechanism (sigma from the accountant) must give eps_LB <= the claimed eps, at
claimed eps 1 and 4, several seeds. Positive control: the same run with the noise deliberately
100x too small for the claim must give eps_LB far above the claim, i.e. the audit catches a broken
mechanism. Both go through ``fedpose.shared.training.loop.local_train``, the loop of ``fedpose train`` and the sites.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from fedpose.shared.configuration.schema import config_from_dict
from fedpose.shared.experiments.audit import AuditSpec, run_audit
from fedpose.shared.privacy.audit.canaries import DiracCanaries, DiracGrads
from fedpose.shared.privacy.step.fpdp import DPSpec, StepAudit, dp_gradient
from fedpose.shared.privacy.step.subspace import flat_vector


def tiny_dict(root) -> dict:
    return {
        "data": {
            "source": "synthetic",
            "root": str(root / "ward"),
            "synth": {"sites": 2, "per_site": 40, "public": 40, "val": 24, "seed": 5, "image_size": 64},
            "train_splits": ["site-0", "site-1"],
            "input_size": [32, 32],
        },
        "model": {"joint_channels": 4, "hidden": 32},
        "pretrain": {"out": str(root / "pre"), "epochs": 1, "batch_size": 16},
        "privacy": {"k": 4, "m": 12, "basis_every": 4, "chunk_size": 16, "delta": 1.0e-5},
        "train": {"epochs": 4, "batch_size": 32, "public_batch_size": 8, "strategy": "finetune"},
    }


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit")
    (root / "cfg.yaml").write_text(yaml.safe_dump(tiny_dict(root)))
    return config_from_dict(tiny_dict(root))


def test_a_dirac_canary_is_clipped_like_a_record_and_noised_with_the_sum():
    # toy loss with 2 parameters of 3 + 2 entries; canary on flat coordinate 3 (b[0] in sorted order a, b)
    params = {"a": torch.zeros(3), "b": torch.zeros(2)}

    def loss_fn(p, batch):
        return (batch["x"] * torch.cat([p["a"], p["b"]])).sum(1)

    batch = {"x": torch.zeros(0, 5)}
    spec = DPSpec(method="dpsgd", clip_norm=0.5, sigma=1e-9, sample_rate=0.5, expected_batch=2.0)
    canary = DiracGrads(coords=torch.tensor([3, 3]), values=torch.tensor([0.5, 7.0]))
    grads, _ = dp_gradient(loss_fn, params, spec=spec, private_batch=batch, psi_batch=None,
                           generator=torch.Generator().manual_seed(0), basis=None, audit=StepAudit(canaries=canary))
    flat = flat_vector(grads)
    # each canary clipped to C = 0.5 (the 7.0 one too), summed, divided by q n = 2
    assert flat[3].item() == pytest.approx((0.5 + 0.5) / 2, rel=1e-5)
    assert flat[[0, 1, 2, 4]].abs().max().item() < 1e-6
    with pytest.raises(ValueError, match="distinct"):
        DiracCanaries(coords=torch.tensor([1, 1]), included=torch.tensor([True, False]), value=1.0)


def test_only_included_canaries_are_drawn_at_rate_q():
    canaries = DiracCanaries(coords=torch.arange(4000), included=torch.arange(4000) % 2 == 0, value=1.0)
    drawn = canaries.draw(0, sample_rate=0.25, generator=torch.Generator().manual_seed(1))
    assert (drawn.coords % 2 == 0).all()
    assert abs(drawn.coords.numel() - 500) < 4 * (2000 * 0.25 * 0.75) ** 0.5


@pytest.mark.slow
@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_audit_is_sound_at_the_claimed_epsilon(cfg, epsilon, tmp_path):
    for seed in (0, 1):
        result = run_audit(cfg, AuditSpec(method="dpsgd", epsilon=epsilon, canaries=1000, seed=seed),
                           tmp_path / f"s{seed}", progress=False)
        assert result["epsilon_claimed"] <= epsilon + 1e-9
        assert result["epsilon_claimed"] == pytest.approx(epsilon, rel=0.02)  # calibrated to the target
        assert 0.0 <= result["epsilon_lb"] <= result["epsilon_claimed"], result
        assert result["sound"]
    saved = json.loads((tmp_path / "s1" / "audit.json").read_text())
    assert saved["epsilon_lb"] == result["epsilon_lb"] and len(saved["scores"]) == 1000
    assert (tmp_path / "s1" / "audit.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.parametrize("epsilon, margin", [(1.0, 2.0), (4.0, 0.0)])
def test_positive_control_a_wrong_sigma_is_caught(cfg, tmp_path, epsilon, margin):
    # The run adds 1% of the noise the claim was calibrated with: a broken mechanism the audit must catch.
    # With m = 1000 canaries the bound cannot exceed 5.27 (all of r = 1000 right at 0.05 / 6; 4.57 for all
    # of r = 500), so the claim of 4 is only just exceeded and the claim of 1 far exceeded.
    result = run_audit(cfg, AuditSpec(method="dpsgd", epsilon=epsilon, canaries=1000, noise_scale=0.01, seed=0),
                       tmp_path, progress=False)
    assert result["epsilon_lb"] > result["epsilon_claimed"] + margin, result
    assert not result["sound"]
    assert result["epsilon_ran"] > result["epsilon_claimed"]  # the accountant on what actually ran
    assert "POSITIVE CONTROL" in result["note"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["proj", "fpdp"])
def test_projection_and_feature_dp_audits_hold_and_say_what_they_claim(cfg, method, tmp_path):
    result = run_audit(cfg, AuditSpec(method=method, epsilon=4.0, canaries=500, seed=2), tmp_path, progress=False)
    assert result["epsilon_lb"] <= result["epsilon_claimed"]
    assert "post-processing" in result["note"]
    if method == "fpdp":
        assert "psi(x)" in result["note"] and "not record-level" in result["note"]


@pytest.mark.slow
def test_an_audit_of_low_rank_adapters_counts_their_coordinates_and_holds(cfg, tmp_path):
    """train.strategy: lora trains adapters local_train puts on the model: the Dirac canaries are drawn over the
    adapters' and the heads' coordinates, and the bound stays below the claim."""
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.model.lora import add_adapters
    from fedpose.shared.model.strategy import apply_strategy
    from fedpose.shared.training.runs import initial_model

    lora = replace(cfg, **{"train.strategy": "lora", "train.lora_rank": 2})
    result = run_audit(lora, AuditSpec(method="dpsgd", epsilon=4.0, canaries=500, seed=2), tmp_path,
                       progress=False)
    assert 0.0 <= result["epsilon_lb"] <= result["epsilon_claimed"], result
    model = initial_model(lora, progress=False)
    add_adapters(model, 2, torch.Generator())
    named = dict(model.named_parameters())
    assert result["trained_coordinates"] == sum(named[n].numel() for n in apply_strategy(model, "lora"))


@pytest.mark.slow
def test_an_audit_of_records_clipped_with_their_blurred_copies_holds(cfg, tmp_path):
    """train.images: raw+psi under the recipe's method: each record's image and blur form one clipped term, a canary
    (in V's span) another; the bound stays below the record-level claim, calibrated as for raw images alone."""
    from fedpose.shared.configuration.schema import replace

    paired = replace(cfg, **{"train.images": "raw+psi"})
    result = run_audit(paired, AuditSpec(method="proj", epsilon=4.0, canaries=500, seed=2), tmp_path,
                       progress=False)
    assert 0.0 <= result["epsilon_lb"] <= result["epsilon_claimed"], result
    assert result["epsilon_claimed"] == pytest.approx(4.0, rel=0.02) and result["epsilon_claimed"] <= 4.0 + 1e-9
    assert "record-level" in result["note"] and "psi(x)" not in result["note"]


@pytest.mark.slow
def test_input_space_canaries_black_box(cfg, tmp_path):
    sound = run_audit(cfg, AuditSpec(method="fdp", epsilon=1.0, canaries=24, mode="input", seed=0), tmp_path,
                      progress=False)
    assert sound["epsilon_lb"] <= sound["epsilon_claimed"] and sound["mode"] == "input"
    with pytest.raises(ValueError, match="held-out"):
        run_audit(cfg, AuditSpec(method="dpsgd", epsilon=1.0, canaries=500, mode="input", seed=0), progress=False)


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="cannot be audited"):
        AuditSpec(method="nonprivate", epsilon=1.0, canaries=10)
    with pytest.raises(ValueError, match="canaries"):
        AuditSpec(method="dpsgd", epsilon=1.0, canaries=1)
    with pytest.raises(ValueError, match="noise_scale"):
        AuditSpec(method="dpsgd", epsilon=1.0, canaries=10, noise_scale=0.0)


@pytest.mark.slow
def test_cli_prints_the_bound_next_to_the_claim(cfg, tmp_path, capsys):
    from fedpose.cli.main import main

    config = Path(cfg.data.root).parent / "cfg.yaml"  # the module's ward and pretrained weights
    code = main(["audit", "--config", str(config), "--method", "dpsgd", "--epsilon", "1", "--canaries", "200",
                 "--seed", "4", "--out", str(tmp_path / "out"), "--quiet"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "claimed eps" in printed and "eps_LB" in printed and "record-level" in printed
    assert "(dirac placement)" in printed
    assert json.loads((tmp_path / "out" / "audit.json").read_text())["placement"] == "dirac"
    assert (tmp_path / "out" / "audit.json").is_file() and (tmp_path / "out" / "audit.png").is_file()
    assert main(["audit", "--config", str(config), "--method", "dpsgd", "--epsilon", "1", "--canaries", "1"]) == 3
    assert "canaries" in capsys.readouterr().err


# --- in-span canaries (proj / fpdp): C V_t u_j, following the basis V_t actually used at step t ---------------


# One site (n = 40, q = 0.8), k = 16, 24 steps: the projected release has k numbers a step, so an in-span audit
# needs more steps and dimensions than the Dirac one to see its canaries (measured on this ward: eps_LB 1.4 to
# 1.9 for the control, claim 0.5; 100 canaries, more add cross-talk between included canaries).
SPAN_CANARIES = 100
SPAN_CONTROL_EPS = 0.5
SPAN_CONTROL_MARGIN = 0.5


@pytest.fixture(scope="module")
def span_cfg(tmp_path_factory, cfg):
    d = tiny_dict(Path(cfg.data.root).parent)  # the same ward
    d["data"]["train_splits"] = ["site-0"]
    d["pretrain"]["out"] = str(tmp_path_factory.mktemp("span") / "pre")
    d["privacy"].update({"k": 16, "m": 32})
    d["train"]["epochs"] = 12
    return config_from_dict(d)


def random_basis(p: int, k: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(p, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q.to(torch.float32)  # (p, k), orthonormal columns


def test_a_span_canary_lies_in_the_basis_in_use_and_is_clipped_to_C():
    from fedpose.shared.privacy.audit.canaries import SpanGrads

    params = {"a": torch.zeros(6), "b": torch.zeros(4)}

    def loss_fn(p, batch):
        return (batch["x"] * torch.cat([p["a"], p["b"]])).sum(1)

    batch = {"x": torch.zeros(0, 10)}
    u = torch.tensor([[0.0, 0.6, 0.8]], dtype=torch.float64)  # one drawn canary, unit u in R^k
    canary = SpanGrads(coeffs=7.0 * u)  # a gradient of norm 7: clipped to C like a record
    spec = DPSpec(method="proj", clip_norm=0.5, sigma=1e-9, sample_rate=0.5, expected_batch=2.0)
    for seed in (0, 1):  # the canary follows whichever V the step projects with
        basis = random_basis(10, 3, seed)
        alone = canary.clipped_sum(10, clip_norm=0.5, like=torch.zeros(10), basis=basis)
        assert alone.norm().item() == pytest.approx(0.5, rel=1e-5)  # norm C after clipping
        assert (alone - basis @ (basis.T @ alone)).norm().item() < 1e-6  # inside span(V)
        grads, _ = dp_gradient(loss_fn, params, spec=spec, private_batch=batch, psi_batch=None,
                               generator=torch.Generator().manual_seed(0), basis=basis,
                               audit=StepAudit(canaries=canary))
        expected = basis.double() @ (0.5 * u[0]) / 2.0  # all of it survives the projection; / (q n)
        assert torch.allclose(flat_vector(grads).double(), expected, atol=1e-6)
    with pytest.raises(ValueError, match="basis"):  # dpsgd has no V: span canaries are refused there
        dp_gradient(loss_fn, params, spec=DPSpec(method="dpsgd", clip_norm=0.5, sigma=1.0, sample_rate=0.5,
                                                   expected_batch=2.0), private_batch=batch, psi_batch=None,
                    generator=torch.Generator().manual_seed(0), basis=None, audit=StepAudit(canaries=canary))


def test_span_canaries_follow_every_refresh_of_the_basis_in_local_train(cfg):
    # Through the real loop: the V each drawn canary batch is built on is the V that step projects with,
    # and it changes at every refresh (basis_every = 4 in the tiny config).
    from fedpose.shared.privacy.audit.canaries import SpanCanaries
    from fedpose.shared.privacy.step.noise import make_generator
    from fedpose.shared.training.runs import ensure_data, initial_model, load_records, private_records
    from fedpose.shared.training.batches import make_dataset
    from fedpose.shared.privacy.audit.hooks import AuditHooks
    from fedpose.shared.training.loop import LocalData, LocalRun, local_train, step_spec

    root = ensure_data(cfg, progress=False)
    model = initial_model(cfg, progress=False)
    k = cfg.privacy.k
    canaries = SpanCanaries.random(m=40, k=k, steps=6, included=torch.arange(40) % 2 == 0, value=1.0, seed=3)
    used, released = [], []

    class Spy:
        def draw(self, step, *, sample_rate, generator):
            drawn = canaries.draw(step, sample_rate=sample_rate, generator=generator)

            class Recorded:
                def clipped_sum(self, total, *, clip_norm, like, basis):
                    used.append(basis)
                    return drawn.clipped_sum(total, clip_norm=clip_norm, like=like, basis=basis)
            return Recorded()

    hooks = AuditHooks(canaries=Spy(), observe=released.append)
    local_data = LocalData(make_dataset(private_records(root, cfg), cfg, train=True, seed=0),
                           public=make_dataset(load_records(root, cfg.data.public_split), cfg, train=False))
    local_run = LocalRun(step_spec("proj", cfg.train, cfg.privacy, sigma=1.0, data=local_data), 6, cfg.train,
                         cfg.privacy)
    result = local_train(model, local_data, local_run, generator=make_generator(0, "cpu")[0], audit=hooks, bar=None)
    assert len(used) == len(released) == 6
    assert result.narrowest_basis == min(basis.shape[1] for basis in used) == cfg.privacy.k  # reported with the run
    for step, (basis, seen) in enumerate(zip(used, released)):
        assert seen.step == step and seen.basis is basis  # the auditor sees the V the canaries were built on
        private = flat_vector(seen.private)
        assert (private - basis @ (basis.T @ private)).norm() < 1e-2 * private.norm()  # float32 V, p ~ 4e5
    assert used[0] is used[3] and used[4] is not used[3]  # refreshed at step 4
    assert not torch.allclose(used[0], used[4])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["proj", "fpdp"])
@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_span_canary_audit_is_sound(span_cfg, method, epsilon):
    for seed in (0, 1):
        result = run_audit(span_cfg, AuditSpec(method=method, epsilon=epsilon, canaries=SPAN_CANARIES, seed=seed),
                           progress=False)
        assert result["placement"] == "span"  # the default for projecting methods
        assert 0.0 <= result["epsilon_lb"] <= result["epsilon_claimed"], result
        assert result["sound"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["proj", "fpdp"])
def test_span_canary_positive_control_is_caught(span_cfg, method):
    # 1% of the calibrated noise: the Dirac audit saw nothing here (eps_LB 0); in-span canaries must.
    result = run_audit(span_cfg, AuditSpec(method=method, epsilon=SPAN_CONTROL_EPS, canaries=SPAN_CANARIES,
                                           noise_scale=0.01, seed=0), progress=False)
    assert result["placement"] == "span"
    assert result["epsilon_lb"] > result["epsilon_claimed"] + SPAN_CONTROL_MARGIN, result
    assert not result["sound"]


def test_canary_placement_is_checked():
    assert AuditSpec(method="fpdp", epsilon=1.0, canaries=10).placement == "span"
    assert AuditSpec(method="proj", epsilon=1.0, canaries=10, placement="dirac").placement == "dirac"
    assert AuditSpec(method="dpsgd", epsilon=1.0, canaries=10).placement == "dirac"
    with pytest.raises(ValueError, match="span"):
        AuditSpec(method="fdp", epsilon=1.0, canaries=10, placement="span")  # no V to lie in
    with pytest.raises(ValueError, match="placement"):
        AuditSpec(method="fpdp", epsilon=1.0, canaries=10, placement="diagonal")


# ---------------------------------------------------------------------------
# patient level (issue #11, item 6): a canary is a canary patient
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("noise_scale", [1.0, 0.01])
def test_patient_level_audit_samples_canary_patients_at_q_p(cfg, tmp_path, noise_scale):
    # At patient level each Dirac canary stands for a patient whose clipped mean gradient is C e_j: it is
    # Poisson-sampled at q_p = B / patients with the real patients and added to their per-patient sum.
    from fedpose.shared.configuration.schema import replace

    patient = replace(cfg, **{"privacy.unit": "patient", "train.batch_size": 4})
    result = run_audit(patient, AuditSpec(method="dpsgd", epsilon=1.0, canaries=1000, noise_scale=noise_scale,
                                          seed=0), tmp_path, progress=False)
    assert result["unit"] == "patient" and result["n"] == result["patients"] < result["records"]
    assert result["sample_rate"] == pytest.approx(4 / result["patients"])
    assert "patient" in result["note"]
    if noise_scale == 1.0:
        assert result["epsilon_lb"] <= result["epsilon_claimed"]
    else:  # the positive control is caught at patient level too
        assert result["epsilon_lb"] > result["epsilon_claimed"] + 1.0, result
    with pytest.raises(ValueError, match="patient"):
        run_audit(patient, AuditSpec(method="dpsgd", epsilon=1.0, canaries=24, mode="input", seed=0),
                  progress=False)
