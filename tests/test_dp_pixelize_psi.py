"""DP pixelization as psi (issue #14's psi ablation): each record released once, the mechanism's noise, the
composed claim, and the boundaries (config validation, centralized only)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedpose.shared.errors import ConfigError
from fedpose.shared.configuration.schema import config_from_dict, replace
from fedpose.shared.configuration.flat import identity_flat
from fedpose.shared.pixelization.spec import PixelizeSpec
from fedpose.shared.privacy.accounting.claims import privacy_claim
from fedpose.shared.privacy.step.psi import apply_psi, psi_label_of, DPPixelize, Pixelate


def _gray(batch: int, h: int = 32, w: int = 24) -> torch.Tensor:
    return torch.full((batch, 3, h, w), 128 / 255)  # mid-grey: no clipping at 0 or 255


def test_each_record_is_released_once_whatever_image_comes_with_its_index():
    psi = DPPixelize(PixelizeSpec(eps=1.0, b=8, m=1), rng=np.random.default_rng(0))
    first = psi(torch.rand(4, 3, 32, 24), torch.arange(4))
    again = psi(torch.rand(4, 3, 32, 24), torch.tensor([3, 2, 1, 0]))  # other pixels, same records
    assert torch.equal(again, first.flip(0))  # the kept release: eps_pix is spent once per record
    assert len(psi.released) == 4
    # seeded alike: the same releases; another seed: others
    twin = DPPixelize(PixelizeSpec(eps=1.0, b=8, m=1), rng=np.random.default_rng(0))
    other = DPPixelize(PixelizeSpec(eps=1.0, b=8, m=1), rng=np.random.default_rng(1))
    images = _gray(2)
    assert torch.equal(twin(images, torch.arange(2)), twin(images, torch.arange(2)))
    assert not torch.equal(twin(images, torch.tensor([7, 8])), other(images, torch.tensor([7, 8])))
    with pytest.raises(ValueError, match="index"):
        apply_psi(psi, {"image": images})
    with pytest.raises(ValueError, match="one record index per image"):
        psi(images, torch.arange(3))


@pytest.mark.parametrize("eps", [1.0, 4.0])
def test_the_noise_is_the_mechanisms_at_its_scale(eps):
    spec = PixelizeSpec(eps=eps, b=8, m=1)
    images = _gray(16)  # 32 x 24 is a multiple of b: K = 1, scale 255 m 3 / (b^2 eps) per released mean
    out = DPPixelize(spec, rng=np.random.default_rng(3))(images, torch.arange(16))
    cells = out[:, :, ::8, ::8]  # one pixel per 8 x 8 cell
    assert torch.allclose(out, Pixelate(block_size=8)(out), atol=1e-6)  # constant on every cell: a pixelization
    deviation = (cells - 128 / 255).abs().mul(255).mean().item()  # (16 x 3 x 4 x 3 cells)
    scale = spec.mean_scale(8, channels=3)
    assert scale == pytest.approx(255 * 3 / (64 * eps))
    assert 0.75 * scale < deviation < 1.25 * scale + 0.5, (deviation, scale)


def test_config_boundaries_and_identity():
    cfg = config_from_dict({"privacy": {"psi": "dp-pixelize", "psi_param": 8, "psi_eps": 2.0, "psi_m": 4}})
    assert psi_label_of(cfg.privacy) == "dp-pixelize(8, eps=2, m=4)"
    assert psi_label_of(config_from_dict({}).privacy) == "blur(0.03)"  # other maps are named as before
    for bad, match in [({"psi_param": 2.5}, "whole pixels"), ({"psi_param": 1}, "whole pixels"),
                       ({"psi_eps": 0.0}, "psi_eps"), ({"psi_eps": float("inf")}, "psi_eps"), ({"psi_m": 0}, "psi_m")]:
        with pytest.raises(ConfigError, match=match):
            config_from_dict({"privacy": {"psi": "dp-pixelize", "psi_param": 8, **bad}})
    # fields added later are left out of identity views at their as-before value (cell ids, cached weights)
    flat = identity_flat(config_from_dict({}))
    assert "privacy.psi_eps" not in flat and "privacy.psi_m" not in flat
    assert identity_flat(cfg)["privacy.psi_eps"] == 2.0


def test_the_claim_composes_eps_pix_for_a_change_of_up_to_m_pixels():
    base = dict(method="fpdp", epsilon=0.8, delta=1e-5, psi="dp-pixelize(8, eps=1, m=4)", seeded=False,
                accountant="rdp")
    composed = privacy_claim(**base, psi_dp=(1.0, 4))
    assert "eps_pix=1 DP pixelization" in composed
    assert "up to 4 pixels in one record's crop is (1.8, 1e-05)-DP" in composed
    assert "j of a patient's records" not in composed
    patient = privacy_claim(**base, psi_dp=(1.0, 1), unit="patient")  # each of a patient's records has its release
    assert "up to 1 pixel in one record's crop is (1.8, 1e-05)-DP" in patient
    assert "in j of a patient's records (eps + j x 1, 1e-05)-DP" in patient
    assert "eps_pix" not in privacy_claim(**base)
    assert "eps_pix" not in privacy_claim(**{**base, "method": "dpsgd", "psi": None}, psi_dp=(1.0, 4))


def test_a_centralized_run_trains_on_the_releases_and_claims_the_composition(world, tmp_path, monkeypatch):
    import fedpose.shared.training.loop as step_module
    from fedpose.shared.training.runs import run_train

    cfg = replace(world, **{"train.method": "fpdp", "train.epochs": 1, "privacy.psi": "dp-pixelize",
                            "privacy.psi_param": 4, "privacy.psi_eps": 2.0, "privacy.psi_m": 2})
    seen: list[dict[int, torch.Tensor]] = []
    real = step_module.dp_gradient

    def spy(loss_fn, params, *, psi_batch, **kwargs):
        seen.append({int(i): image.clone() for i, image in zip(psi_batch.tensors["index"], psi_batch.tensors["image"])})
        return real(loss_fn, params, psi_batch=psi_batch, **kwargs)

    monkeypatch.setattr(step_module, "dp_gradient", spy)
    metrics = run_train(cfg, tmp_path / "run", progress=False)
    assert len(seen) >= 2
    releases: dict[int, torch.Tensor] = {}
    for step in seen:
        for index, image in step.items():
            assert torch.equal(releases.setdefault(index, image), image)  # the same release at every step
    assert sum(len(step) for step in seen) > len(releases)  # some record came back and got no fresh draw
    image = next(iter(releases.values()))
    assert torch.allclose(image, Pixelate(block_size=4)(image[None])[0], atol=1e-6)
    assert "psi(x) = dp-pixelize(4, eps=2, m=2)" in metrics["claim"]
    assert f"({metrics['epsilon'] + 2.0:.4g}, " in metrics["claim"]
    assert "up to 2 pixels in one record's crop" in metrics["claim"]


def test_a_federation_refuses_dp_pixelize_before_anything_runs(world, tmp_path):
    from fedpose.server.run import run_federation

    cfg = replace(world, **{"privacy.psi": "dp-pixelize", "privacy.psi_param": 4})
    with pytest.raises(ConfigError, match="centralized runs only"):
        run_federation(None, cfg, tmp_path / "out")
    assert not (tmp_path / "out" / "ledger.sqlite").exists()
