"""Record-level DP recipes: augmentation multiplicity, the bitfit strategy, the weight average.

Augmentation multiplicity (``privacy.augment_multiplicity``) is checked against a per-example loop (each
record's term is clip(mean of its K copies' gradients, C), the copies' gradients taken one example at a time),
and the accountant's input is shown not to depend on K (still one clipped term per record). bitfit trains
exactly the norms, the biases and the heads; the weight average is post-processing of the iterates.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from support.models import record_loop, recorded_train


@pytest.mark.parametrize("copies", [2, 4])
def test_multiplicity_clips_the_mean_of_each_records_copies_like_a_per_example_loop(toy_pose, copies):
    """g = (sum_records clip(mean_k g_{i,k}, C) + N(0, sigma^2 C^2 I)) / B: one clipped term per record."""
    from fedpose.shared.privacy.step.fpdp import DPSpec, dp_gradient
    from fedpose.shared.privacy.step.noise import gaussian_noise_like, make_generator
    from fedpose.shared.privacy.step.sampling import augmented_copies
    from fedpose.shared.privacy.step.subspace import flat_vector
    from support.toy import make_batch

    loss_fn, params = toy_pose
    records = 5
    rows, groups = augmented_copies(torch.tensor([3, 7, 8, 12, 20]), copies)
    assert rows.tolist() == [i for i in (3, 7, 8, 12, 20) for _ in range(copies)]
    assert groups.tolist() == [j for j in range(records) for _ in range(copies)]
    batch = make_batch(records * copies, seed=5)  # every row its own image: the copies' different augmentations
    unclipped = record_loop(loss_fn, params, batch, copies, clip=1e9)
    norms = [float(record_loop(loss_fn, params, {k: v[r * copies:(r + 1) * copies] for k, v in batch.items()},
                                copies, clip=1e9).norm()) for r in range(records)]
    clip = sorted(norms)[2] * 1.01  # some records clipped, some not
    want_sum = record_loop(loss_fn, params, batch, copies, clip=clip)
    assert not torch.allclose(want_sum, unclipped)  # clipping did something
    spec = DPSpec(method="dpsgd", clip_norm=clip, sigma=1.3, sample_rate=0.25, expected_batch=4.0,
                  multiplicity=copies, chunk_size=3)  # chunks that split a record's copies
    got, info = dp_gradient(loss_fn, params, spec=spec, private_batch=batch, groups=groups, psi_batch=None,
                            generator=make_generator(8, "cpu")[0], basis=None)
    noise = gaussian_noise_like(params, std=1.3 * clip, generator=make_generator(8, "cpu")[0])
    torch.testing.assert_close(flat_vector(got), (want_sum + flat_vector(noise)) / 4.0, rtol=1e-5, atol=1e-6)
    assert info["batch_size"] == records and info["unit"] == "record"  # records, not rows
    # the clipped mean of K copies is not the sum of K clipped copies (what K records would give)
    rowwise = record_loop(loss_fn, params, batch, 1, clip=clip)
    assert not torch.allclose(rowwise, want_sum, rtol=1e-3)


def test_multiplicity_needs_the_record_of_every_copy_and_record_level(toy_pose):
    from fedpose.shared.privacy.step.fpdp import DPSpec, dp_gradient
    from fedpose.shared.privacy.step.noise import make_generator
    from support.toy import make_batch

    loss_fn, params = toy_pose
    spec = DPSpec(method="dpsgd", clip_norm=1.0, sigma=1.0, sample_rate=0.5, expected_batch=2.0, multiplicity=2)
    with pytest.raises(ValueError, match="groups"):
        dp_gradient(loss_fn, params, spec=spec, private_batch=make_batch(4), psi_batch=None,
                    generator=make_generator(0, "cpu")[0], basis=None)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="multiplicity"):
            DPSpec(method="dpsgd", clip_norm=1.0, sigma=1.0, sample_rate=0.5, expected_batch=2.0, multiplicity=bad)
    with pytest.raises(ValueError, match="multiplicity"):
        DPSpec(method="dpsgd", clip_norm=1.0, sigma=1.0, sample_rate=0.5, expected_batch=2.0, multiplicity=2,
               unit="patient")
    from fedpose.shared.privacy.step.sampling import augmented_copies

    rows, groups = augmented_copies(torch.zeros(0, dtype=torch.long), 3)  # an empty Poisson draw stays empty
    assert rows.numel() == 0 and groups.numel() == 0
    with pytest.raises(ValueError, match="copies"):
        augmented_copies(torch.tensor([1, 2]), 0)


def test_config_validates_the_recipe_fields():
    from fedpose.shared.errors import ConfigError
    from fedpose.shared.configuration.schema import config_from_dict

    cfg = config_from_dict({})
    assert cfg.privacy.augment_multiplicity == 1 and cfg.train.ema == 0.0
    cfg = config_from_dict({"privacy": {"augment_multiplicity": 4}, "train": {"ema": 0.99, "strategy": "bitfit"}})
    assert (cfg.privacy.augment_multiplicity, cfg.train.ema, cfg.train.strategy) == (4, 0.99, "bitfit")
    for bad in (0, 65, 2.5, "4"):
        with pytest.raises(ConfigError, match="augment_multiplicity"):
            config_from_dict({"privacy": {"augment_multiplicity": bad}})
    with pytest.raises(ConfigError, match="augment_multiplicity"):
        config_from_dict({"privacy": {"augment_multiplicity": 2, "unit": "patient"}})
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ConfigError, match="train.ema"):
            config_from_dict({"train": {"ema": bad}})
    assert cfg.privacy.basis_clip is None
    assert config_from_dict({"privacy": {"basis_clip": 1.0}}).privacy.basis_clip == 1.0
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(ConfigError, match="privacy.basis_clip"):
            config_from_dict({"privacy": {"basis_clip": bad}})


def test_new_fields_at_their_default_keep_the_ids_of_cells_and_caches():
    from fedpose.shared.configuration.schema import config_from_dict, replace
    from fedpose.shared.configuration.flat import identity_flat

    cfg = config_from_dict({})
    flat = identity_flat(cfg)
    assert not {"privacy.augment_multiplicity", "train.ema", "privacy.basis_clip", "train.lora_rank"} & set(flat)
    moved = identity_flat(replace(cfg, **{"privacy.augment_multiplicity": 2, "train.ema": 0.9,
                                          "privacy.basis_clip": 1.0, "train.lora_rank": 4}))
    assert (moved["privacy.augment_multiplicity"], moved["train.ema"], moved["privacy.basis_clip"],
            moved["train.lora_rank"]) == (2, 0.9, 1.0, 4)


@pytest.mark.parametrize("strategy", ["bitfit", "bitfit-head"])
def test_bitfit_trains_the_norms_and_the_biases_and_bitfit_head_the_heads_too(strategy):
    from torch import nn

    from fedpose.shared.configuration.schema import config_from_dict
    from fedpose.shared.model.posenet import TASK_SCALE, build_model
    from fedpose.shared.model.pose_loss import make_loss_fn
    from fedpose.shared.model.strategy import trainable_names
    from fedpose.shared.privacy.step import bookkeeping

    cfg = config_from_dict({})
    model = build_model(cfg.model, cfg.data.input_size)
    names = trainable_names(model, strategy)
    norms = {f"{m}.{p}" for m, mod in model.named_modules() if isinstance(mod, nn.LayerNorm)
             for p, _ in mod.named_parameters(recurse=False)}
    for name, param in model.named_parameters():
        head = strategy == "bitfit-head" and name.startswith("head.")
        want = name != TASK_SCALE and (head or name in norms or name.endswith(".bias"))
        assert (name in names) == want, name  # the task weights stay at their public values
    assert any(n.startswith("stages.0.") for n in names)  # the whole trunk's biases, not only the last stage
    total = sum(p.numel() for p in model.parameters())
    share = sum(p.numel() for n, p in model.named_parameters() if n in set(names)) / total
    assert share < (0.15 if strategy == "bitfit-head" else 0.02)
    named = dict(model.named_parameters())
    assert bookkeeping.supports(make_loss_fn(model, names), {n: named[n] for n in names})  # the fast path


def test_full_fixed_tasks_trains_every_weight_but_the_task_weights():
    from fedpose.shared.configuration.schema import config_from_dict
    from fedpose.shared.model.posenet import TASK_SCALE, build_model
    from fedpose.shared.model.pose_loss import make_loss_fn
    from fedpose.shared.model.strategy import trainable_names
    from fedpose.shared.privacy.step import bookkeeping

    cfg = config_from_dict({"train": {"strategy": "full-fixed-tasks"}})
    model = build_model(cfg.model, cfg.data.input_size)
    names = trainable_names(model, cfg.train.strategy)
    assert names == [n for n, _ in model.named_parameters() if n != TASK_SCALE]
    named = dict(model.named_parameters())
    assert bookkeeping.supports(make_loss_fn(model, names), {n: named[n] for n in names})


def test_weight_average_is_the_exponential_average_of_the_iterates():
    from fedpose.shared.training.weight_average import WeightAverage

    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    avg = WeightAverage([w], decay=0.75)
    want = w.detach().clone()
    for step in range(5):
        with torch.no_grad():
            w.add_(torch.tensor([0.5 * step, 1.0]))
        avg.update()
        want = 0.75 * want + 0.25 * w.detach()
    torch.testing.assert_close(avg.shadow[0], want)
    avg.copy_to()
    torch.testing.assert_close(w.detach(), want)
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="decay"):
            WeightAverage([w], decay=bad)


def test_local_train_augments_each_record_k_times_and_accounts_as_without(world, monkeypatch):
    """Same Poisson draw of records, K rows each with their own augmentation, the record of each row as its
    group; (sigma, q, steps), the accountant's whole input, is that of K = 1, so epsilon does not move."""
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.privacy.accounting.accountant import StepRecord, epsilon_spent

    base = replace(world, **{"train.method": "dpsgd", "train.batch_size": 4})
    plain_seen, many_seen = [], []
    _, plain = recorded_train(base, 3, plain_seen, monkeypatch)
    _, many = recorded_train(replace(base, **{"privacy.augment_multiplicity": 3}), 3, many_seen, monkeypatch)
    assert (many.sigma, many.sample_rate, many.steps, many.n) == (plain.sigma, plain.sample_rate, plain.steps,
                                                                 plain.n)
    eps = [epsilon_spent([StepRecord(sigma=r.sigma, sample_rate=r.sample_rate, steps=r.steps)], delta=1e-5)
           for r in (plain, many)]
    assert eps[0] == eps[1]
    for (spec1, images1, groups1, _), (spec3, images3, groups3, _) in zip(plain_seen, many_seen):
        assert spec1.multiplicity == 1 and groups1 is None
        assert spec3.multiplicity == 3 and spec3.sample_rate == spec1.sample_rate
        records = images1.shape[0]  # the same generator draws the same records
        assert images3.shape[0] == 3 * records
        assert groups3.tolist() == [j for j in range(records) for _ in range(3)]
        for j in range(records):  # the copies of a record are different augmentations of it
            copies = images3[3 * j:3 * j + 3]
            assert not torch.equal(copies[0], copies[1]) and not torch.equal(copies[1], copies[2])


def test_local_train_bitfit_leaves_the_other_weights_and_ema_releases_the_average(world, monkeypatch):
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.training.runs import initial_model

    cfg = replace(world, **{"train.method": "dpsgd", "train.batch_size": 4, "train.strategy": "bitfit",
                            "train.schedule": "constant"})
    start = {n: p.detach().clone() for n, p in initial_model(cfg, progress=False).named_parameters()}
    model, _ = recorded_train(cfg, 2, [], monkeypatch)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), start[n])}
    from fedpose.shared.model.strategy import trainable_names

    assert moved and moved <= set(trainable_names(model, "bitfit"))
    # with the average on, the same run (same seeds, so the same iterates w1, w2) ends at 0.25 w0 + 0.25 w1 + 0.5 w2
    first, _ = recorded_train(cfg, 1, [], monkeypatch)
    averaged, _ = recorded_train(replace(cfg, **{"train.ema": 0.5}), 2, [], monkeypatch)
    w1, w2 = dict(first.named_parameters()), dict(model.named_parameters())
    for name, p in averaged.named_parameters():
        want = 0.25 * start[name] + 0.25 * w1[name].detach() + 0.5 * w2[name].detach()
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-7)
        if name in moved:
            assert not torch.allclose(p.detach(), w2[name].detach())


def test_tensor_adam_keeps_each_tensors_gradient_direction_and_rescales_tensors_apart():
    """optimizer 'tensor-adam': Adam with one second moment per weight tensor (the mean of g^2 over the tensor).

    Within a tensor the step is the first moment divided by one number, so a projected noisy gradient keeps its
    direction there (per-coordinate Adam divides each coordinate apart: a noise-only coordinate takes a full step);
    across tensors it rescales like Adam, so a tensor whose gradients are 1000 times smaller moves as far.
    """
    from fedpose.shared.configuration.schema import TrainConfig
    from fedpose.shared.training.schedule import make_optimizer

    torch.manual_seed(0)
    big = torch.zeros(30, requires_grad=True)
    small = torch.zeros(4, 5, requires_grad=True)
    opt = make_optimizer([big, small], TrainConfig(method="proj", optimizer="tensor-adam", lr=0.01))
    g_big, g_small = torch.randn(30), 1e-3 * torch.randn(4, 5)
    big.grad, small.grad = g_big.clone(), g_small.clone()
    opt.step()
    for moved, grad in ((big.detach(), g_big), (small.detach(), g_small)):
        cos = torch.nn.functional.cosine_similarity(-moved.flatten(), grad.flatten(), dim=0)
        assert cos > 1 - 1e-5  # the tensor's gradient direction, not its signs
        # first step, bias-corrected: m / sqrt(v) = g / rms(g), so the tensor's step has RMS lr
        assert float(moved.pow(2).mean().sqrt()) == pytest.approx(0.01, rel=1e-4)
    state = opt.state_dict()
    again = make_optimizer([big, small], TrainConfig(method="proj", optimizer="tensor-adam", lr=0.01))
    again.load_state_dict(state)  # a site keeping its optimizer across rounds saves and loads it
    assert again.state_dict()["state"][0]["exp_avg_sq"].numel() == 1


def test_dp_tensor_adam_damps_a_tensor_whose_gradient_is_the_declared_noise_alone():
    """optimizer 'dp-tensor-adam': tensor-adam told each tensor's DP noise variance (known: sigma, C, B and V).

    Its step is tensor-adam's times the tensor's signal share, s^2 / (s^2 + the noise variance left in the first
    moment), with s^2 the tensor's running mean of g^2 less the noise variance. A tensor whose gradient is the
    declared noise alone barely moves (tensor-adam gives it full steps: a random walk of the noise); a tensor whose
    gradient is mostly signal steps as tensor-adam; told no noise, it is tensor-adam.
    """
    from fedpose.shared.configuration.schema import TrainConfig
    from fedpose.shared.training.schedule import make_optimizer

    def walk(optimizer: str, noise: list[float] | None) -> tuple[float, float]:
        gen = torch.Generator().manual_seed(3)
        signal, noisy = torch.zeros(50, requires_grad=True), torch.zeros(50, requires_grad=True)
        opt = make_optimizer([signal, noisy], TrainConfig(method="proj", optimizer=optimizer, lr=0.01))
        if noise is not None:
            opt.set_noise_variance(noise)
        for _ in range(300):
            signal.grad = 1.0 + 0.1 * torch.randn(50, generator=gen)  # signal 1, noise variance 0.01
            noisy.grad = 0.5 * torch.randn(50, generator=gen)  # noise alone, variance 0.25
            opt.step()
        return float(signal.detach().norm()), float(noisy.detach().norm())

    plain_signal, plain_noise = walk("tensor-adam", None)
    dp_signal, dp_noise = walk("dp-tensor-adam", [0.01, 0.25])
    assert dp_signal == pytest.approx(plain_signal, rel=0.05)  # the signal's tensor: tensor-adam's steps
    assert dp_noise < 0.2 * plain_noise  # the noise's tensor: damped
    assert walk("dp-tensor-adam", [0.0, 0.0]) == pytest.approx((plain_signal, plain_noise), rel=1e-5)
    with pytest.raises(ValueError, match="2 weight tensors"):
        make_optimizer([torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)],
                       TrainConfig(method="proj", optimizer="dp-tensor-adam")).set_noise_variance([0.1])


def test_local_train_tells_dp_tensor_adam_the_noise_its_step_adds(world, monkeypatch):
    """dpsgd: (sigma C / B)^2 on every coordinate; projected, a tensor's share std^2 ||V_t||^2 spread over it,
    which is what V (V^T z) puts there (checked against draws of z)."""
    import fedpose.shared.training.loop as step_module
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.privacy.step.subspace import project
    from fedpose.shared.training.tensor_adam import noise_variances

    made = []
    real = step_module.make_optimizer
    monkeypatch.setattr(step_module, "make_optimizer", lambda params, train: made.append(real(params, train))
                        or made[-1])
    cfg = replace(world, **{"train.method": "dpsgd", "train.batch_size": 4, "train.optimizer": "dp-tensor-adam"})
    recorded_train(cfg, 2, [], monkeypatch)
    (opt,) = made
    std = 1.0 * cfg.privacy.clip_norm / 4  # recorded_train's sigma 1.0, C, the expected batch B
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(opt.noise) == len(params) and all(opt.noise[p] == pytest.approx(std ** 2) for p in params)

    gen = torch.Generator().manual_seed(0)
    shapes = {"b": (3, 4), "a": (5,), "c": (2,)}
    basis = torch.linalg.qr(torch.randn(sum(math.prod(s) for s in shapes.values()), 4, generator=gen))[0]
    sizes = [(name, math.prod(shape)) for name, shape in shapes.items()]  # the optimizer's order, not sorted
    want = noise_variances(sizes, sorted(shapes), std=0.5, basis=basis)
    draws = torch.stack([project(basis, 0.5 * torch.randn(basis.shape[0], generator=gen)) for _ in range(20000)])
    offsets = {"a": (0, 5), "b": (5, 17), "c": (17, 19)}  # flat_vector's sorted order
    for (name, _), variance in zip(sizes, want):
        lo, hi = offsets[name]
        assert float(draws[:, lo:hi].pow(2).mean()) == pytest.approx(variance, rel=0.05)


@pytest.mark.parametrize("fast", [True, False])
def test_tensor_scales_clip_each_records_scaled_gradient_like_a_per_example_loop(fast):
    """train.tensor_scales: public. Each record's gradient, every tensor t times its public scale a_t, clipped to C
    as one vector: sum_i clip(a * g_i, C), so one record still moves the sum by at most C (the accountant's input
    unchanged), and the sum equals a per-example loop, through the book-keeping tape and the generic path alike."""
    from support.models import generic_loss, model_setup

    from fedpose.shared.privacy.step.fpdp import clipped_grad_sum
    from fedpose.shared.privacy.step.subspace import flat_vector

    model, loss_fn, params, batch = model_setup("tinyvit-5m", "finetune", size=5)
    gen = torch.Generator().manual_seed(5)
    scales = {name: float(10 ** (3 * torch.rand((), generator=gen) - 1.5)) for name in params}  # 0.03 .. 30
    want, norms = None, []
    for row in range(5):
        leaves = {n: p.clone().requires_grad_(True) for n, p in params.items()}
        loss = loss_fn(leaves, {k: v[row:row + 1] for k, v in batch.items()}).sum()
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        flat = flat_vector({n: scales[n] * g for n, g in grads.items()})
        norms.append(float(flat.norm()))
        clipped = flat * min(1.0, 0.05 / (norms[-1] + 1e-6))
        want = clipped if want is None else want + clipped
    got = clipped_grad_sum(loss_fn if fast else generic_loss(loss_fn), params, batch, clip_norm=0.05, chunk_size=2,
                           scales=scales)
    assert max(norms) > 0.05  # some records are clipped
    torch.testing.assert_close(got.norms, torch.tensor(norms, dtype=torch.float64), rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(flat_vector(got.summed), want, rtol=2e-4, atol=2e-7)


@pytest.mark.invariant("P2")
def test_public_tensor_scales_give_every_tensor_the_same_rms_on_public_data():
    """a_t = c / rms_t, rms_t the RMS of tensor t's per-sample public gradients and c their RMS over every
    coordinate: scaled, each tensor's public gradients have RMS c, the overall RMS (so C keeps its meaning)."""
    from support.models import model_setup

    from fedpose.shared.privacy.step.persample import per_sample_grads
    from fedpose.shared.privacy.step.subspace import public_scales

    import inspect

    assert list(inspect.signature(public_scales).parameters) == ["loss_fn", "params", "public_batch", "chunk_size",
                                                                 "per_coordinate"]
    model, loss_fn, params, batch = model_setup("tinyvit-5m", "finetune", size=6)
    scales = public_scales(loss_fn, params, batch, chunk_size=4)
    grads = per_sample_grads(loss_fn, params, batch, chunk_size=6)
    overall = float(torch.cat([g.reshape(-1) for g in grads.values()]).pow(2).mean().sqrt())
    for name, g in grads.items():
        if float(g.abs().max()) > 0:
            assert float((scales[name] * g).pow(2).mean().sqrt()) == pytest.approx(overall, rel=1e-3)
        else:
            assert scales[name] == 1.0  # a tensor without public gradient keeps its scale
    # with a projection, one pass gives the same scales and a V spanning the scaled public gradients (k = m here)
    from fedpose.shared.privacy.step.subspace import compute_scaled_basis, flat_vector, project

    assert list(inspect.signature(compute_scaled_basis).parameters) == ["loss_fn", "params", "public_batch", "k",
                                                                        "chunk_size", "rtol", "clip", "per_coordinate"]
    basis, same = compute_scaled_basis(loss_fn, params, batch, k=6, chunk_size=4)
    assert same.keys() == scales.keys() and all(same[n] == pytest.approx(scales[n], rel=1e-6) for n in scales)
    for row in range(6):
        scaled = flat_vector({name: scales[name] * g[row] for name, g in grads.items()})
        torch.testing.assert_close(project(basis, scaled), scaled, rtol=1e-3, atol=1e-3 * float(scaled.abs().max()))


def test_local_train_scales_each_step_from_the_public_split_and_accounts_as_without(world, monkeypatch):
    """train.tensor_scales: public. The step gets the public scales at the current weights (every basis_every
    steps), and the run's (sigma, q, steps), the accountant's whole input, is that of the unscaled run. Refused,
    before any step, without the public split (a site) or at patient level."""
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.model.pose_loss import make_loss_fn
    from fedpose.shared.model.strategy import apply_train_strategy
    from fedpose.shared.privacy.step.subspace import public_scales
    from fedpose.shared.training.batches import make_dataset, to_device
    from fedpose.shared.training.runs import initial_model

    base = replace(world, **{"train.method": "dpsgd", "train.batch_size": 4, "privacy.m": 8,
                             "privacy.basis_every": 2})
    scaled_cfg = replace(base, **{"train.tensor_scales": "public"})
    plain_seen, scaled_seen = [], []
    _, plain = recorded_train(base, 3, plain_seen, monkeypatch, public=True)
    _, scaled = recorded_train(scaled_cfg, 3, scaled_seen, monkeypatch, public=True)
    assert (scaled.sigma, scaled.sample_rate, scaled.steps) == (plain.sigma, plain.sample_rate, plain.steps)
    assert all(seen[3] is None for seen in plain_seen)
    model = initial_model(scaled_cfg, progress=False)
    names = apply_train_strategy(model, scaled_cfg.train)
    public = make_dataset(load_split(base.data.root, base.data.public_split), base, train=False)
    batch = to_device(public.batch(list(range(8))), torch.device("cpu"))
    named = dict(model.named_parameters())
    want = public_scales(make_loss_fn(model, names), {n: named[n].detach() for n in names}, batch,
                         chunk_size=base.privacy.chunk_size)
    first = scaled_seen[0][3]
    assert first.keys() == want.keys() and all(first[n] == pytest.approx(want[n], rel=1e-4) for n in want)
    assert scaled_seen[1][3] is first and scaled_seen[2][3] is not first  # refreshed at step 2
    projected_seen = []  # proj: the scales come with V, from the same public samples and weights
    recorded_train(replace(scaled_cfg, **{"train.method": "proj", "privacy.k": 4}), 1, projected_seen, monkeypatch,
           public=True)
    with_basis = projected_seen[0][3]
    assert with_basis.keys() == want.keys() and all(with_basis[n] == pytest.approx(want[n], rel=1e-4) for n in want)
    with pytest.raises(ValueError, match="needs the public split"):
        recorded_train(scaled_cfg, 1, [], monkeypatch)


def test_a_run_whose_weights_diverge_stops_saying_so_when_its_public_statistics_are_due(world, monkeypatch):
    """A step so large that the weights leave float range: the next refresh of the public scales (or of V) found
    no finite public gradient and stopped blaming the public samples. It now stops naming the divergence, the
    step and the learning rate, as a failed run (RuntimeError: one line and exit 5 from the command line)."""
    from fedpose.shared.configuration.schema import replace

    cfg = replace(world, **{"train.method": "dpsgd", "train.batch_size": 4, "privacy.m": 8, "privacy.basis_every": 2,
                            "train.tensor_scales": "public", "train.optimizer": "sgd", "train.momentum": 0.9,
                            "train.lr": 1.0e30, "train.schedule": "constant"})
    with pytest.raises(RuntimeError, match=r"diverged.*step 2.*train.lr"):
        recorded_train(cfg, 4, [], monkeypatch, public=True)
    with pytest.raises(RuntimeError, match=r"diverged.*step 2.*train.lr"):
        recorded_train(replace(cfg, **{"train.method": "proj", "privacy.k": 4}), 4, [], monkeypatch, public=True)


@pytest.mark.invariant("P2")
def test_public_coordinate_scales_precondition_each_coordinate_from_public_gradients_before_clipping():
    """train.tensor_scales: coordinate (AdaDPS): a_j = c / max(rms_j, floor c), rms_j the RMS of coordinate j's
    per-sample public gradients and c their RMS over every coordinate: scaled, every coordinate whose public RMS is
    above the floor has RMS c. The step clips each record's scaled gradient, sum_i clip(a * g_i, C), exactly as a
    per-example loop does, so one record still moves the sum by at most C."""
    from support.models import model_setup

    from fedpose.shared.privacy.step.fpdp import clipped_grad_sum
    from fedpose.shared.privacy.step.persample import per_sample_grads
    from fedpose.shared.privacy.step.subspace import COORDINATE_FLOOR, flat_vector, public_scales

    model, loss_fn, params, batch = model_setup("tinyvit-5m", "finetune", size=6)
    scales = public_scales(loss_fn, params, batch, chunk_size=4, per_coordinate=True)
    grads = per_sample_grads(loss_fn, params, batch, chunk_size=6)
    overall = float(torch.cat([g.reshape(-1) for g in grads.values()]).double().pow(2).mean().sqrt())
    above = 0
    for name, g in grads.items():
        assert scales[name].shape == params[name].shape
        rms = g.double().pow(2).mean(0).sqrt()
        scaled = (scales[name] * g).double().pow(2).mean(0).sqrt()
        live = rms > COORDINATE_FLOOR * overall
        torch.testing.assert_close(scaled[live], torch.full_like(scaled[live], overall), rtol=1e-3, atol=0.0)
        torch.testing.assert_close(scales[name][~live].double(),
                                   torch.full_like(rms[~live], 1 / COORDINATE_FLOOR), rtol=1e-4, atol=0.0)
        above += int(live.sum())
    assert above > 0
    want = None
    for row in range(6):
        flat = flat_vector({n: scales[n] * g[row] for n, g in grads.items()})
        clipped = flat * min(1.0, 0.05 / (float(flat.norm()) + 1e-6))
        want = clipped if want is None else want + clipped
    got = clipped_grad_sum(loss_fn, params, batch, clip_norm=0.05, chunk_size=4, scales=scales)
    assert float(got.norms.max()) > 0.05  # some records are clipped
    torch.testing.assert_close(flat_vector(got.summed), want, rtol=2e-4, atol=2e-7)


@pytest.mark.parametrize("method", ["dpsgd", "proj"])
def test_a_long_dp_run_keeps_the_task_weights_inside_their_non_private_range(world, monkeypatch, method):
    """The task-uncertainty weights under record-level DP: their per-sample gradient (three numbers of one sign
    for every record) takes a large share of each record's clip, and over thousands of DP steps the visibility
    log-scale ran to -11 (e^22 on one loss term) against -1.7 to -5.1 without DP. Under dpsgd and proj they stay,
    by default, at their public values, which lie inside the non-private range (the start is where non-private
    training begins); a run that asks for them (train.task_weights: train) still trains them."""
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.model.posenet import TASK_SCALE
    from fedpose.shared.training.runs import initial_model

    start = dict(initial_model(world, progress=False).named_parameters())[TASK_SCALE].detach().clone()
    base = replace(world, **{"train.method": method, "train.batch_size": 4, "privacy.m": 8, "privacy.k": 4,
                             "train.optimizer": "sgd", "train.momentum": 0.9, "train.lr": 0.3,
                             "train.schedule": "constant"})
    steps = 30
    nonprivate, _ = recorded_train(replace(base, **{"train.method": "nonprivate"}), steps, [], monkeypatch,
                                   public=True)
    moved = dict(nonprivate.named_parameters())[TASK_SCALE].detach()
    low, high = torch.minimum(start, moved), torch.maximum(start, moved)
    private, _ = recorded_train(base, steps, [], monkeypatch, public=True)
    kept = dict(private.named_parameters())[TASK_SCALE].detach()
    assert bool(((kept >= low) & (kept <= high)).all()), (kept, low, high)
    torch.testing.assert_close(kept, start)  # the public values, exactly
    trained, _ = recorded_train(replace(base, **{"train.task_weights": "train"}), steps, [], monkeypatch,
                                public=True)
    assert not torch.equal(dict(trained.named_parameters())[TASK_SCALE].detach(), start)


def test_v_keeps_its_k_directions_when_a_few_public_rows_dwarf_the_rest(toy_pose):
    """V's public rows as a long DP run left them: a few public samples whose gradients grew 1e5 to 1e11 times the
    median (the runaway task weight). Unclipped, the eigenvalues of G G^T span 22 orders of magnitude and V kept one
    direction of the 50 asked; by default (privacy.basis_rows: clipped) every row is clipped to C first, as the
    private step clips a record's, and V keeps its k directions. V is public: the clip costs no privacy."""
    from support.toy import make_batch

    from fedpose.shared.configuration.schema import PrivacyConfig
    from fedpose.shared.privacy.step.subspace import basis_clip_of, check_orthonormal, compute_basis

    loss_fn, params = toy_pose
    batch = make_batch(16, seed=3)
    batch["joints"][0] *= 1e11  # the squared error, and so the row, of sample 0: about 1e11 times the median's
    batch["joints"][1:3] *= 1e5
    k = 8
    default = PrivacyConfig(k=k, m=16)
    assert basis_clip_of(default) == default.clip_norm
    kept = compute_basis(loss_fn, params, batch, k=k, chunk_size=4, clip=basis_clip_of(default))
    assert kept.shape[1] == k
    check_orthonormal(kept)
    raw = PrivacyConfig(k=k, m=16, basis_rows="raw")
    assert basis_clip_of(raw) is None
    collapsed = compute_basis(loss_fn, params, batch, k=k, chunk_size=4, clip=basis_clip_of(raw))
    assert collapsed.shape[1] <= 3  # what a run's V was before the clip


LONG_RUN = Path(__file__).parent / "support" / "weights" / "ward6400-dpsgd.pt"


def test_v_keeps_its_k_directions_at_the_weights_of_a_long_run_at_6400_records_per_site(tmp_path):
    """V at the weights a long record-level run left at 6,400 records per site (19,200 pooled: full-dimension dpsgd,
    570 steps at batch 1,024, eps 0.8; stored in float16, ``LONG_RUN``), from 100 public images of the ward's
    style: by default (task weights at their public values, public rows clipped to C) V keeps all k = 50
    directions. With the visibility task's log-scale where the old default (task weights trained) left it at that
    size (-11.2) and raw public rows, as runs were before, V loses directions at these same weights; clipping the
    rows alone brings them back."""
    from dataclasses import replace

    from fedpose.shared.configuration.schema import load_config
    from fedpose.shared.model.pose_loss import make_loss_fn
    from fedpose.shared.model.posenet import load_checkpoint
    from fedpose.shared.model.strategy import apply_strategy
    from fedpose.shared.privacy.step.subspace import public_basis_at
    from fedpose.shared.training.batches import make_dataset
    from fedpose.shared.training.runs import ensure_data, load_records

    cfg = load_config(Path(__file__).parents[1] / "configs" / "default.yaml",
                      {"data.root": str(tmp_path / "ward"), "data.synth.per_site": 1, "data.synth.val": 1,
                       "data.synth.public": 100})
    public = make_dataset(load_records(ensure_data(cfg, progress=False), cfg.data.public_split), cfg, train=False)
    assert len(public) == cfg.privacy.m == 100 and cfg.privacy.k == 50

    def basis(runaway: bool, *, fixed_tasks: bool, rows: str) -> int:
        model, meta = load_checkpoint(LONG_RUN)
        assert meta["steps"] == 570 and round(1024 / meta["sample_rate"]) == 19_200  # a long run, 19,200 records
        if runaway:
            with torch.no_grad():
                model.head.log_task_scale[2] = -11.2
        trainable = apply_strategy(model, "full", fixed_tasks=fixed_tasks)
        privacy = replace(cfg.privacy, basis_rows=rows)
        return public_basis_at(model, make_loss_fn(model, trainable), trainable, public, privacy,
                               torch.device("cpu")).shape[1]

    assert cfg.train.task_weights == "auto" and cfg.privacy.basis_rows == "clipped"  # the defaults
    assert basis(False, fixed_tasks=True, rows="clipped") == 50
    assert basis(True, fixed_tasks=False, rows="raw") < 50  # the old default's weights and rows
    assert basis(True, fixed_tasks=False, rows="clipped") == 50


def test_the_ward_holds_out_a_basis_split_from_pretraining_with_people_of_its_own():
    """V's public images held out from pretraining: the ward's "basis" split (data.synth.basis images, the public
    camera, people who appear in no other split), named by data.basis_split, never a private, validation or
    pretraining split. A ward without it is the ward it always was (its manifest unchanged)."""
    import dataclasses

    from fedpose.shared.configuration.schema import ConfigError, DataConfig
    from fedpose.shared.data.synth.ward import WardSpec, manifest_for, render_sample

    spec = WardSpec(sites=1, per_site=2, public=2, val=2, image_size=64, images_per_identity=1, basis=2)
    assert spec.splits()["basis"] == 2
    held = {render_sample(spec, "basis", i)[2] for i in range(2)}
    public = {render_sample(spec, "public", i)[2] for i in range(2)}
    assert held and not held & public
    assert "basis" not in manifest_for(dataclasses.replace(spec, basis=0))["splits"]
    assert manifest_for(dataclasses.replace(spec, basis=0)) == manifest_for(
        WardSpec(sites=1, per_site=2, public=2, val=2, image_size=64, images_per_identity=1))
    assert DataConfig(basis_split="basis").basis_split == "basis"
    for taken in ("public", "val", "site-0"):
        with pytest.raises(ConfigError, match="data.basis_split"):
            DataConfig(basis_split=taken)


def test_the_clipped_step_without_noise_reports_an_unbounded_epsilon_and_no_guarantee(world, tmp_path):
    """privacy.noise_multiplier: 0, the ceiling of a clipped recipe: each record's gradient clipped, no noise. The
    run says what it is: epsilon infinite (no accountant bounds it), a claim of no privacy guarantee, sigma 0."""
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.training.runs import run_train

    cfg = replace(world, **{"train.method": "dpsgd", "train.epochs": 1, "train.batch_size": 8,
                            "privacy.noise_multiplier": 0.0, "train.seed": 0})
    metrics = run_train(cfg, tmp_path / "clipped", progress=False)
    assert metrics["sigma"] == 0.0 and metrics["epsilon"] == math.inf
    assert metrics["claim"].startswith("no privacy guarantee (epsilon unbounded)")
    fixed = run_train(replace(cfg, **{"privacy.noise_multiplier": 2.0}), tmp_path / "fixed", progress=False)
    assert fixed["sigma"] == 2.0 and math.isfinite(fixed["epsilon"]) and fixed["epsilon"] > 0
