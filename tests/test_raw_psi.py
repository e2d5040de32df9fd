"""``train.images: raw+psi``: a record-level FP-DP, each record's image and psi of its canonical crop clipped as one.

What a user relies on: the same Poisson draw of records as with raw images, each record giving two rows (its
augmented image, then psi of its canonical crop) that form one clipping group, the accountant's input unchanged
(the pair is one record's contribution, bounded by C), and a refusal, before anything trains, of the
combinations whose claim it would blur (fdp / fpdp, patient level, augmentation multiplicity).
"""

from __future__ import annotations

import pytest
import torch

from support.models import recorded_train


def _psi_of_every_crop(cfg, seed=0):
    import fedpose.shared.training.batches as batches
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.privacy.step.psi import apply_psi

    crops = batches.make_dataset(load_split(cfg.data.root, "site-0"), cfg, train=True, seed=seed).canonical()
    psi = batches.make_psi_from(cfg.privacy, torch.Generator().manual_seed(0))
    return apply_psi(psi, crops.batch(list(range(len(crops))))).tensors["image"]


def _closest(images: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """For each image, the largest absolute difference to its nearest candidate."""
    return torch.stack([(candidates - image).abs().flatten(1).amax(1).min() for image in images])


def test_each_record_gives_its_image_and_psi_of_its_crop_as_one_group_and_accounts_as_raw(world, monkeypatch):
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.privacy.accounting.accountant import StepRecord, epsilon_spent

    base = replace(world, **{"train.method": "proj", "train.batch_size": 4})
    raw_seen, pair_seen = [], []
    _, raw = recorded_train(base, 3, raw_seen, monkeypatch, public=True)
    _, pair = recorded_train(replace(base, **{"train.images": "raw+psi"}), 3, pair_seen, monkeypatch, public=True)
    assert (pair.sigma, pair.sample_rate, pair.steps, pair.n) == (raw.sigma, raw.sample_rate, raw.steps, raw.n)
    eps = [epsilon_spent([StepRecord(sigma=r.sigma, sample_rate=r.sample_rate, steps=r.steps)], delta=1e-5)
           for r in (raw, pair)]
    assert eps[0] == eps[1]
    blurred = _psi_of_every_crop(base)
    drawn = 0
    for (spec1, images1, groups1, _), (spec2, images2, groups2, _) in zip(raw_seen, pair_seen, strict=True):
        assert spec1.multiplicity == 1 and groups1 is None
        assert spec2.multiplicity == 2 and spec2.sample_rate == spec1.sample_rate
        records = images1.shape[0]  # the same generator draws the same records, augmented alike
        drawn += records
        assert images2.shape[0] == 2 * records
        assert groups2.tolist() == [j for j in range(records) for _ in range(2)]
        torch.testing.assert_close(images2[0::2], images1, rtol=0, atol=0)  # each record's own image first
        if records:
            assert float(_closest(images2[1::2], blurred).max()) < 1e-6  # then psi of a record's canonical crop
            assert float(_closest(images2[0::2], blurred).min()) > 1e-3  # never a raw image's psi in its place
    assert drawn > 0


def test_the_blurred_row_is_the_psi_of_the_same_records_crop(world, monkeypatch):
    """Row 2j + 1 is psi of the crop of the record row 2j shows: the pair is one record, not two."""
    from fedpose.shared.configuration.schema import replace

    import fedpose.shared.training.loop as step_module

    cfg = replace(world, **{"train.method": "dpsgd", "train.batch_size": 6, "train.images": "raw+psi"})
    drawn = []
    real = step_module.poisson_sample

    def remember(*args, **kwargs):
        drawn.append(real(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(step_module, "poisson_sample", remember)
    seen = []
    recorded_train(cfg, 2, seen, monkeypatch)
    blurred = _psi_of_every_crop(cfg)
    assert [len(d) for d in drawn] == [s[1].shape[0] // 2 for s in seen]
    for idx, (_, images, _, _) in zip(drawn, seen, strict=True):
        torch.testing.assert_close(images[1::2], blurred[idx], rtol=0, atol=1e-6)


def test_nonprivate_raw_psi_trains_on_both_without_groups(world, monkeypatch):
    from fedpose.shared.configuration.schema import replace

    seen = []
    cfg = replace(world, **{"train.method": "nonprivate", "train.batch_size": 4, "train.images": "raw+psi"})
    recorded_train(cfg, 2, seen, monkeypatch)
    blurred = _psi_of_every_crop(cfg)
    for spec, images, groups, _ in seen:
        assert spec.multiplicity == 1 and groups is None and images.shape[0] == 8
        assert float(_closest(images[1::2], blurred).max()) < 1e-6


@pytest.mark.parametrize("change, words", [
    ({"train.method": "fpdp"}, "method is 'fpdp'"),
    ({"train.method": "fdp"}, "method is 'fdp'"),
    ({"train.method": "dpsgd", "privacy.augment_multiplicity": 2}, "augment_multiplicity 2"),
])
def test_raw_psi_is_refused_where_its_pair_would_not_be_one_records_bound(world, monkeypatch, change, words):
    from fedpose.shared.configuration.schema import replace

    seen = []
    cfg = replace(world, **{"train.images": "raw+psi", **change})
    with pytest.raises(ValueError, match=words):
        recorded_train(cfg, 1, seen, monkeypatch, public=True)
    assert seen == []  # refused before a step


def test_raw_psi_is_refused_at_patient_level():
    from fedpose.shared.configuration.schema import Config
    from fedpose.shared.privacy.step.fpdp import DPSpec
    from fedpose.shared.training.loop import LocalRun

    cfg = Config()
    train = cfg.train.__class__(**{**cfg.train.__dict__, "method": "dpsgd", "images": "raw+psi"})
    step = DPSpec(method="dpsgd", clip_norm=1.0, sigma=1.0, sample_rate=0.1, expected_batch=4.0, unit="patient")
    with pytest.raises(ValueError, match="privacy.unit 'patient'"):
        LocalRun(step, 1, train, cfg.privacy)


def test_a_steps_noisy_sum_clips_each_records_image_and_blur_as_one_like_a_per_example_loop(world):
    """The rows a raw+psi step samples, through the real pose model: (sum_i clip((g(x_i) + g(psi_i)) / 2, C) +
    N(0, sigma^2 C^2 I)) / B, each pair's mean by its own autograd calls, equals what the step releases."""
    import dataclasses

    import fedpose.shared.training.batches as batches
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.privacy.step.fpdp import dp_gradient
    from fedpose.shared.privacy.step.noise import gaussian_noise_like, make_generator
    from fedpose.shared.privacy.step.subspace import flat_vector
    from fedpose.shared.training.loop import LocalData, LocalRun, StepPhases, step_spec
    from fedpose.shared.training.runs import initial_model

    cfg = replace(world, **{"train.method": "dpsgd", "train.batch_size": 6, "train.images": "raw+psi"})
    data = LocalData(batches.make_dataset(load_split(cfg.data.root, "site-0"), cfg, train=True, seed=0))
    run = LocalRun(step_spec("dpsgd", cfg.train, cfg.privacy, sigma=1.3, data=data), 1, cfg.train, cfg.privacy)
    model = initial_model(cfg, progress=False).eval()
    phases = StepPhases(model, data, run, make_generator(3)[0], basis=None, optimizer=None, audit=None)
    batch, groups = phases.sample()
    records = batch["image"].shape[0] // 2
    assert records >= 3 and groups.tolist() == [j for j in range(records) for _ in range(2)]
    params = {name: phases.named[name].detach() for name in phases.trainable}
    loss_fn = phases.loss_fn
    rows = []  # each row's gradient by its own autograd call
    for row in range(2 * records):
        leaves = {n: p.clone().requires_grad_(True) for n, p in params.items()}
        loss = loss_fn(leaves, {k: v[row:row + 1] for k, v in batch.items()}).sum()
        rows.append(flat_vector(dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))))
    pairs = [(rows[2 * r] + rows[2 * r + 1]) / 2 for r in range(records)]
    clip = sorted(float(m.norm()) for m in pairs)[records // 2] * 1.01  # some pairs clipped, some not

    def clipped_sum(vectors):
        return sum(v * min(1.0, clip / (float(v.norm()) + 1e-6)) for v in vectors)

    want = clipped_sum(pairs)
    spec = dataclasses.replace(run.step, clip_norm=clip, chunk_size=3)  # chunks that split a record's pair
    got, info = dp_gradient(loss_fn, params, spec=spec, private_batch=batch, groups=groups, psi_batch=None,
                            generator=make_generator(8, "cpu")[0], basis=None)
    noise = gaussian_noise_like(params, std=1.3 * clip, generator=make_generator(8, "cpu")[0])
    torch.testing.assert_close(flat_vector(got), (want + flat_vector(noise)) / spec.expected_batch, rtol=1e-4,
                               atol=1e-5)
    assert info["batch_size"] == records  # records, not rows
    assert not torch.allclose(clipped_sum(rows), want, rtol=1e-3)  # not the image and its blur as two records
