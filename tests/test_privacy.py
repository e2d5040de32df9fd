"""Tests of the privacy package: per-sample gradients, noise, sampling, basis, psi,
the FP-DP step and the claim texts (invariants P1-P4, P7, P8).

Everything runs on a tiny toy model (conv + LayerNorm + linear, no BatchNorm)
through the same functional loss interface the pose model uses:
loss_fn(params, batch) -> (B,) per-sample losses.
"""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from torch.func import functional_call

from fedpose.shared.privacy.accounting.claims import privacy_claim
from fedpose.shared.privacy.step.fpdp import DPSpec, dp_gradient, private_gradient, public_gradient, clipped_grad_sum
from fedpose.shared.privacy.step.noise import gaussian_noise_like, make_generator
from fedpose.shared.privacy.step.persample import clip_factors, mean_grad, per_sample_grads, per_sample_norms
from fedpose.shared.privacy.step.psi import PsiBatch, apply_psi, GaussianBlur, Pixelate, make_psi
from fedpose.shared.privacy.step.sampling import poisson_sample
from fedpose.shared.privacy.step.subspace import (check_orthonormal, compute_basis, flat_vector, flat_vector_per_sample,
                                                  from_flat_vector, project, projection_basis)
from support.toy import H, W, ToyPose, make_batch


@pytest.fixture
def toy():
    """(loss_fn, trainable params); conv.bias is frozen to exercise the closure path."""
    torch.manual_seed(0)
    model = ToyPose()
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if n != "conv.bias"}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if n == "conv.bias"}

    def loss_fn(params, batch):
        pred = functional_call(model, {**frozen, **params}, (batch["image"],))  # (B, 16, 2)
        err = ((pred - batch["joints"]) ** 2).sum(-1) * batch["visible"]  # (B, 16)
        return err.sum(1) / batch["visible"].sum(1).clamp(min=1.0)  # (B,)

    return loss_fn, trainable


def loop_grads(loss_fn, params, batch):
    """Reference: one autograd call per example."""
    size = batch["image"].shape[0]
    out = {n: [] for n in params}
    for i in range(size):
        leaves = {n: p.clone().requires_grad_(True) for n, p in params.items()}
        sample = {k: v[i : i + 1] for k, v in batch.items()}
        loss = loss_fn(leaves, sample).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()))
        for n, g in zip(leaves, grads):
            out[n].append(g)
    return {n: torch.stack(gs) for n, gs in out.items()}


def projector(basis: torch.Tensor) -> torch.Tensor:
    b = basis.double()
    return b @ b.T


# ---------------------------------------------------------------- per-sample


def test_per_sample_grads_match_per_example_loop(toy):
    loss_fn, params = toy
    batch = make_batch(7)
    fast = per_sample_grads(loss_fn, params, batch, chunk_size=3)
    slow = loop_grads(loss_fn, params, batch)
    assert set(fast) == set(params)
    for name in params:
        assert fast[name].shape == (7, *params[name].shape)
        torch.testing.assert_close(fast[name], slow[name], rtol=1e-5, atol=1e-6)
    # samples really differ, so a broadcast of one gradient would fail above
    assert not torch.allclose(fast["head.weight"][0], fast["head.weight"][1])


@pytest.mark.invariant("P14")
def test_clipping_bounds_every_per_sample_norm(toy):
    loss_fn, params = toy
    batch = make_batch(12)
    grads = per_sample_grads(loss_fn, params, batch, chunk_size=12)
    norms = per_sample_norms(grads)
    flat = flat_vector_per_sample(grads)
    torch.testing.assert_close(norms, flat.norm(dim=1).double(), rtol=1e-6, atol=1e-6)  # flat norm, ALL params
    clip = float(norms.median())  # about half the samples get clipped
    factors = clip_factors(norms, clip)
    clipped = flat * factors[:, None].float()  # (B, p)
    assert (clipped.norm(dim=1) <= clip * (1 + 1e-6)).all()
    assert (norms > clip).any() and (norms < clip).any()
    small = norms < clip
    torch.testing.assert_close(clipped[small], flat[small])  # small ones untouched
    summed, returned_norms, _ = clipped_grad_sum(
        loss_fn, params, batch, clip_norm=clip, chunk_size=5
    )
    torch.testing.assert_close(returned_norms, norms, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(flat_vector(summed), clipped.sum(0), rtol=1e-5, atol=1e-6)


def test_chunking_gives_the_same_sum(toy):
    loss_fn, params = toy
    batch = make_batch(11)
    reference, ref_norms, _ = clipped_grad_sum(loss_fn, params, batch, clip_norm=0.5, chunk_size=11)
    for chunk in (1, 4, 64):
        summed, norms, _ = clipped_grad_sum(loss_fn, params, batch, clip_norm=0.5, chunk_size=chunk)
        torch.testing.assert_close(norms, ref_norms, rtol=1e-6, atol=1e-6)
        for name in params:
            torch.testing.assert_close(summed[name], reference[name], rtol=1e-5, atol=1e-6)


def test_empty_batch_gives_zero_sum_and_no_norms(toy):
    loss_fn, params = toy
    empty = make_batch(0)
    summed, norms, _ = clipped_grad_sum(loss_fn, params, empty, clip_norm=1.0, chunk_size=4)
    assert norms.shape == (0,)
    for name, value in params.items():
        assert summed[name].shape == value.shape
        assert not summed[name].any()
    grads = per_sample_grads(loss_fn, params, empty, chunk_size=4)
    assert grads["head.weight"].shape == (0, *params["head.weight"].shape)


@pytest.mark.parametrize("clip", [0.0, -1.0, float("inf")])
def test_clip_norm_must_be_positive(toy, clip):
    loss_fn, params = toy
    with pytest.raises(ValueError, match="clip_norm"):
        clipped_grad_sum(loss_fn, params, make_batch(2), clip_norm=clip, chunk_size=2)


def test_batch_with_mismatched_sizes_is_refused(toy):
    loss_fn, params = toy
    batch = make_batch(3)
    batch["joints"] = batch["joints"][:2]
    with pytest.raises(ValueError, match="disagree"):
        clipped_grad_sum(loss_fn, params, batch, clip_norm=1.0, chunk_size=2)


# ---------------------------------------------------------------- noise, P7


@pytest.mark.invariant("P7")
def test_noise_std_matches_sigma_times_clip_and_seed_reproduces():
    sigma, clip = 1.4, 0.5
    like = {"a": torch.zeros(300, 400), "b": torch.zeros(50_000)}  # 170k coordinates
    gen, seeded = make_generator(1234, "cpu")
    assert seeded
    noise = gaussian_noise_like(like, std=sigma * clip, generator=gen)
    values = flat_vector(noise)
    count = values.numel()
    expected = sigma * clip
    # std of the sample std is about expected / sqrt(2 N): 0.17 % here; allow ~6 of them
    assert abs(values.std().item() - expected) < 0.01 * expected
    assert abs(values.mean().item()) < 5 * expected / count**0.5
    assert noise["a"].shape == (300, 400)
    again = gaussian_noise_like(like, std=sigma * clip, generator=make_generator(1234, "cpu")[0])
    assert all(torch.equal(noise[k], again[k]) for k in like)
    # insertion order does not change the draws
    reordered = gaussian_noise_like(
        {"b": like["b"], "a": like["a"]}, std=sigma * clip, generator=make_generator(1234, "cpu")[0]
    )
    assert all(torch.equal(noise[k], reordered[k]) for k in like)
    one, seeded_one = make_generator(None, "cpu")
    two, _ = make_generator(None, "cpu")
    assert not seeded_one
    first = gaussian_noise_like(like, std=1.0, generator=one)
    second = gaussian_noise_like(like, std=1.0, generator=two)
    assert not torch.equal(first["b"], second["b"])


@pytest.mark.invariant("P7")
def test_seeded_generator_warns_not_for_production(caplog):
    with caplog.at_level(logging.WARNING, logger="fedpose.shared.privacy.step.noise"):
        make_generator(None, "cpu")
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="fedpose.shared.privacy.step.noise"):
        make_generator(7, "cpu")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and "not for production" in warnings[0].getMessage().lower()


def test_noise_std_validation():
    gen, _ = make_generator(0, "cpu")
    with pytest.raises(ValueError, match="std"):
        gaussian_noise_like({"a": torch.zeros(3)}, std=-1.0, generator=gen)


# ---------------------------------------------------------------- sampling, P4


@pytest.mark.invariant("P4")
def test_poisson_sampling_rate_and_independence():
    gen, _ = make_generator(5, "cpu")
    n, q = 400_000, 0.05
    idx = poisson_sample(n, sample_rate=q, generator=gen)
    assert idx.dtype == torch.long
    assert torch.equal(idx, torch.unique(idx))  # sorted, no repeats
    assert idx.min() >= 0 and idx.max() < n
    sd = (n * q * (1 - q)) ** 0.5
    assert abs(idx.numel() - n * q) < 5 * sd
    sizes = {poisson_sample(1000, sample_rate=0.1, generator=gen).numel() for _ in range(30)}
    assert len(sizes) > 1  # the batch size is random, not fixed


@pytest.mark.parametrize(
    ("n", "q", "match"),
    [
        (0, 0.1, "empty"),
        (10, 0.0, "sample_rate"),
        (10, 1.5, "sample_rate"),
        (10, float("nan"), "sample_rate"),
    ],
)
def test_poisson_sampling_validation(n, q, match):
    gen, _ = make_generator(0, "cpu")
    with pytest.raises(ValueError, match=match):
        poisson_sample(n, sample_rate=q, generator=gen)


# ---------------------------------------------------------------- subspace, P2


def test_flatten_order_is_sorted_names_and_roundtrips():
    a, b = torch.arange(6.0).view(2, 3), torch.arange(6.0, 10.0)
    one = flat_vector({"b": b, "a": a})
    two = flat_vector({"a": a, "b": b})
    assert torch.equal(one, two)
    assert torch.equal(one, torch.cat([a.reshape(-1), b]))
    back = from_flat_vector(one, like={"b": b, "a": a})
    assert torch.equal(back["a"], a) and torch.equal(back["b"], b)
    with pytest.raises(ValueError, match="entries"):
        from_flat_vector(torch.zeros(9), like={"a": a, "b": b})


def test_projection_basis_spans_top_singular_subspace():
    gen = torch.Generator().manual_seed(3)
    m, p, k = 6, 50, 3
    left = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))[0]
    right = torch.linalg.qr(torch.randn(p, m, generator=gen, dtype=torch.float64))[0]
    spectrum = torch.tensor([10.0, 7.0, 5.0, 2.0, 1.0, 0.5], dtype=torch.float64)
    grads = (left * spectrum) @ right.T  # (m, p) with known singular values
    basis = projection_basis(grads.float(), k)
    assert basis.shape == (p, k) and basis.dtype == torch.float32
    check_orthonormal(basis)
    svd_u = torch.linalg.svd(grads.T, full_matrices=False)[0][:, :k]  # (p, k)
    torch.testing.assert_close(projector(basis), svd_u @ svd_u.T, rtol=0, atol=1e-5)
    # project() is that projector, and idempotent
    vec = torch.randn(p, generator=gen)
    once = project(basis, vec)
    torch.testing.assert_close(once.double(), projector(basis) @ vec.double(), rtol=0, atol=1e-5)
    torch.testing.assert_close(project(basis, once), once, rtol=0, atol=1e-5)


def test_the_basis_of_g_as_it_comes_chunk_by_chunk_and_tensor_by_tensor_is_the_basis_of_g():
    """compute_basis never copies the per-sample gradients into one m x p matrix: it builds V from G's row chunks
    (chunks of public samples) and column groups (tensors) as they come, with the same V as from G itself."""
    from fedpose.shared.privacy.step.subspace import basis_from_blocks

    gen = torch.Generator().manual_seed(5)
    grads = torch.randn(23, 300, generator=gen) * torch.linspace(3, 0.1, 300)
    row_ends, col_ends = [0, 10, 18, 23], [0, 100, 250, 300]
    rows = [[grads[r0:r1, c0:c1] for c0, c1 in zip(col_ends, col_ends[1:])] for r0, r1 in zip(row_ends, row_ends[1:])]
    blocked, whole = basis_from_blocks(rows, 7), projection_basis(grads, 7)
    check_orthonormal(blocked)
    torch.testing.assert_close(projector(blocked), projector(whole), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="line up"):
        basis_from_blocks([rows[0], rows[1][:2]], 3)
    with pytest.raises(ValueError, match="line up"):
        basis_from_blocks([rows[0], [grads[10:18, :90], *rows[1][1:]]], 3)


def test_a_basis_from_clipped_public_gradients_is_not_taken_by_one_outlier():
    """One public sample whose gradient is 1e8 times the others' (a task weight run away during training) makes
    G G^T's top eigenvalue so large that every other direction falls below the rank tolerance: V narrows to that
    one sample. Clipping each public per-sample gradient to C first (``clip``), as the private step clips each
    record's, gives V the top directions of the clipped gradients, every one of them kept."""
    from fedpose.shared.privacy.step.subspace import basis_from_blocks

    gen = torch.Generator().manual_seed(11)
    ordinary = torch.randn(20, 300, generator=gen) * torch.linspace(3, 0.1, 300)  # norms ~ 20
    outlier = torch.randn(1, 300, generator=gen)
    grads = torch.cat([ordinary, outlier / outlier.norm() * 1e8])
    assert basis_from_blocks([[grads]], 10, fewer=True).shape == (300, 1)  # taken by the outlier
    clipped = grads / grads.norm(dim=1, keepdim=True).clamp_min(1.0)  # every row clipped to norm 1
    basis = basis_from_blocks([[grads[:12, :100], grads[:12, 100:]], [grads[12:, :100], grads[12:, 100:]]], 10,
                              fewer=True, clip=1.0)
    assert basis.shape == (300, 10)
    check_orthonormal(basis)
    svd_u = torch.linalg.svd(clipped.double().T, full_matrices=False)[0][:, :10]
    torch.testing.assert_close(projector(basis), svd_u @ svd_u.T, rtol=0, atol=1e-4)
    small = grads[:20] / 100  # rows below the clip are left as they are
    torch.testing.assert_close(projector(basis_from_blocks([[small]], 5, clip=1.0)),
                               projector(projection_basis(small, 5)), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="clip"):
        basis_from_blocks([[grads]], 3, clip=0.0)


def test_every_basis_a_step_projects_with_is_laid_out_column_by_column(toy, tmp_path):
    """The projection reads V fastest with V's columns contiguous (V^T stored row by row): with V stored row by
    row, V^T g took 2.7x as long, every step of a round. The server's V, the V a site takes off the wire (whatever
    layout the server sent) or from its cache, and the V the training loop is handed all come in that layout,
    with the same values."""
    from fedpose.client.basis import cache_basis, cached_basis
    from fedpose.shared.flower.messages import basis_record, record_basis
    from fedpose.shared.privacy.step.subspace import basis_from_blocks, column_major
    from tests.test_site_releases import _policy_stub

    def by_columns(basis: torch.Tensor) -> bool:
        return basis.T.is_contiguous()

    loss_fn, params = toy
    computed = compute_basis(loss_fn, params, make_batch(8, seed=10), k=4, chunk_size=3)
    assert by_columns(computed)
    grads = torch.randn(9, 40, generator=torch.Generator().manual_seed(2))
    assert by_columns(projection_basis(grads, 3))
    assert by_columns(basis_from_blocks([[grads[:5, :15], grads[:5, 15:]], [grads[5:, :15], grads[5:, 15:]]], 3))
    rows = torch.linalg.qr(torch.randn(300, 6, dtype=torch.float64))[0].float().contiguous()  # row by row
    assert not by_columns(rows)
    for dtype in ("float16", "float32"):
        _, received = record_basis(basis_record(rows, version=1, dtype=dtype))
        assert by_columns(received) and received.dtype == torch.float32
        torch.testing.assert_close(received, rows, rtol=0, atol=1e-3 if dtype == "float16" else 0)
    policy = _policy_stub(tmp_path)
    cache_basis(policy, "f", 1, rows)
    again = cached_basis(policy, "f", 1)
    assert by_columns(again) and torch.equal(again, rows)
    laid = column_major(rows)
    assert by_columns(laid) and torch.equal(laid, rows) and column_major(laid) is laid
    vector = torch.randn(300)
    torch.testing.assert_close(project(laid, vector), project(rows, vector), rtol=0, atol=1e-6)


def test_projection_basis_refuses_bad_k_and_rank_deficiency():
    gen = torch.Generator().manual_seed(4)
    grads = torch.randn(4, 30, generator=gen)
    with pytest.raises(ValueError, match="exceeds the number of public samples"):
        projection_basis(grads, 5)
    with pytest.raises(ValueError, match="positive int"):
        projection_basis(grads, 0)
    rank_two = torch.randn(4, 2, generator=gen) @ torch.randn(2, 30, generator=gen)
    with pytest.raises(ValueError, match="numerical rank 2"):
        projection_basis(rank_two, 3)
    assert projection_basis(rank_two, 2).shape == (30, 2)
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = grads.clone()
        broken[2, 17] = bad
        with pytest.raises(ValueError, match="NaN/inf"):
            projection_basis(broken, 2)


def test_check_orthonormal_refuses_bad_bases():
    basis = torch.linalg.qr(torch.randn(20, 4, generator=torch.Generator().manual_seed(0)))[0]
    check_orthonormal(basis)
    with pytest.raises(ValueError, match="not orthonormal"):
        check_orthonormal(basis * 1.1)
    skewed = basis.clone()
    skewed[:, 1] += 0.05 * skewed[:, 0]
    with pytest.raises(ValueError, match="not orthonormal"):
        check_orthonormal(skewed)
    with pytest.raises(ValueError, match="2-d"):
        check_orthonormal(basis[:, 0])


@pytest.mark.invariant("P2")
def test_compute_basis_depends_only_on_public_batch_and_weights(toy):
    loss_fn, params = toy
    names = list(inspect.signature(compute_basis).parameters)
    assert names == ["loss_fn", "params", "public_batch", "k", "chunk_size", "rtol", "clip"]  # data: public only
    public = make_batch(8, seed=10)
    basis = compute_basis(loss_fn, params, public, k=4, chunk_size=3)
    assert basis.shape == (sum(v.numel() for v in params.values()), 4)
    check_orthonormal(basis)
    copy = {name: value.clone() for name, value in public.items()}
    same = compute_basis(loss_fn, params, copy, k=4, chunk_size=5)
    torch.testing.assert_close(same, basis, rtol=0, atol=1e-6)
    # it is the top-k subspace of the public per-sample gradients (reference: loop + SVD)
    matrix = flat_vector_per_sample(loop_grads(loss_fn, params, public)).double()  # (m, p)
    svd_u = torch.linalg.svd(matrix.T, full_matrices=False)[0][:, :4]
    torch.testing.assert_close(projector(basis), svd_u @ svd_u.T, rtol=0, atol=1e-4)
    # other public data or other weights give another subspace
    other = compute_basis(loss_fn, params, make_batch(8, seed=11), k=4, chunk_size=3)
    assert (projector(other) - projector(basis)).abs().max() > 1e-2
    moved = {n: v + 0.3 for n, v in params.items()}
    at_new_weights = compute_basis(loss_fn, moved, public, k=4, chunk_size=3)
    assert (projector(at_new_weights) - projector(basis)).abs().max() > 1e-2


# ---------------------------------------------------------------- psi


def test_gaussian_blur_scales_with_input_and_smooths():
    blur = GaussianBlur(blur_sigma_frac=0.05)
    sigma, radius = blur.kernel_size(256, 192)
    assert sigma == pytest.approx(9.6) and radius == 29  # odd kernel 59 ~ 6 sigma
    sigma_small, _ = blur.kernel_size(64, 48)
    assert sigma_small == pytest.approx(2.4)
    constant = torch.full((2, 3, 32, 24), 0.3)
    torch.testing.assert_close(blur(constant), constant)  # normalised kernel, reflect pad
    checker = ((torch.arange(32)[:, None] + torch.arange(24)[None, :]) % 2).float()
    images = checker.expand(2, 3, 32, 24).contiguous()
    out = blur(images)
    assert out.shape == images.shape
    assert out.std() < 0.05 * images.std()  # high frequencies removed
    assert torch.equal(out, blur(images))  # deterministic
    assert blur.name == "gaussian_blur" and "0.05" in blur.describe()


def test_pixelate_block_means_and_partial_blocks():
    image = torch.arange(25.0).view(1, 1, 5, 5)
    out = Pixelate(block_size=2)(image)
    assert out.shape == image.shape
    assert out[0, 0, 0, 0] == out[0, 0, 1, 1] == (0 + 1 + 5 + 6) / 4
    assert out[0, 0, 0, 4] == (4 + 9) / 2  # partial block: valid pixels only
    assert out[0, 0, 4, 4] == 24


def test_make_psi_and_validation():
    assert isinstance(make_psi("gaussian_blur", blur_sigma_frac=0.02), GaussianBlur)
    assert make_psi("pixelate", block_size=4) == Pixelate(block_size=4)
    with pytest.raises(ValueError, match="unknown psi"):
        make_psi("jpeg")
    with pytest.raises(ValueError, match="blur_sigma_frac"):
        GaussianBlur(blur_sigma_frac=0.0)
    with pytest.raises(ValueError, match="block_size"):
        Pixelate(block_size=1)
    with pytest.raises(ValueError, match="float"):
        Pixelate(block_size=2)(torch.zeros(1, 3, 4, 4, dtype=torch.uint8))


# ---------------------------------------------------------------- FP-DP step


def spec_for(method: str, **overrides) -> DPSpec:
    values = dict(
        method=method, clip_norm=0.5, sigma=1.3, sample_rate=0.25, expected_batch=5.0, chunk_size=4
    )
    values.update(overrides)
    return DPSpec(**values)


@pytest.mark.invariant("P1")
def test_p1_noise_added_once_to_the_sum_then_projected(toy):
    loss_fn, params = toy
    batch = make_batch(5)
    basis = compute_basis(loss_fn, params, make_batch(8, seed=20), k=3, chunk_size=8)
    spec = spec_for("proj")
    got = private_gradient(
        loss_fn, params, batch, spec=spec, generator=make_generator(99, "cpu")[0], basis=basis
    )
    # manual Algorithm 1 with the same generator: one draw, added to the clipped sum
    summed, _, _ = clipped_grad_sum(loss_fn, params, batch, clip_norm=0.5, chunk_size=5)
    noise = gaussian_noise_like(summed, std=1.3 * 0.5, generator=make_generator(99, "cpu")[0])
    noisy = (flat_vector(summed) + flat_vector(noise)) / (0.25 * 20)
    torch.testing.assert_close(flat_vector(got), project(basis, noisy), rtol=1e-5, atol=1e-6)
    # adding the noise after projecting would leave an out-of-span component
    wrong = project(basis, flat_vector(summed)) / 5.0 + flat_vector(noise) / 5.0
    assert (flat_vector(got) - wrong).abs().max() > 1e-2


@pytest.mark.invariant("P1")
def test_p1_with_empty_batch_the_step_is_projected_noise_only(toy):
    loss_fn, params = toy
    basis = compute_basis(loss_fn, params, make_batch(8, seed=20), k=3, chunk_size=8)
    got = private_gradient(
        loss_fn, params, make_batch(0), spec=spec_for("proj"),
        generator=make_generator(5, "cpu")[0], basis=basis,
    )
    flat = flat_vector(got)
    assert flat.norm() > 0  # the noise is there even with no samples
    residual = flat - project(basis, flat)
    assert residual.norm() < 1e-5 * flat.norm()  # entirely in span(V)
    noise = gaussian_noise_like(params, std=0.65, generator=make_generator(5, "cpu")[0])
    torch.testing.assert_close(flat, project(basis, flat_vector(noise) / 5.0), rtol=1e-5, atol=1e-6)


@pytest.mark.invariant("P1")
def test_dpsgd_is_clipped_sum_plus_one_noise_draw_over_qn(toy):
    loss_fn, params = toy
    batch = make_batch(6)
    got = private_gradient(
        loss_fn, params, batch, spec=spec_for("dpsgd"), generator=make_generator(8, "cpu")[0],
        basis=None,
    )
    summed, _, _ = clipped_grad_sum(loss_fn, params, batch, clip_norm=0.5, chunk_size=6)
    gen = make_generator(8, "cpu")[0]
    first = gaussian_noise_like(summed, std=0.65, generator=gen)
    second = gaussian_noise_like(summed, std=0.65, generator=gen)
    expected = (flat_vector(summed) + flat_vector(first)) / 5.0
    torch.testing.assert_close(flat_vector(got), expected, rtol=1e-5, atol=1e-6)
    twice = (flat_vector(summed) + flat_vector(first) + flat_vector(second)) / 5.0
    assert (flat_vector(got) - twice).abs().max() > 1e-2


@pytest.mark.invariant("P4", "P15")
def test_p4_p15_normalisation_uses_the_public_expected_batch(toy):
    loss_fn, params = toy
    one = make_batch(1, seed=30)
    three = {k: v.repeat(3, *([1] * (v.dim() - 1))) for k, v in one.items()}
    seven = {k: v.repeat(7, *([1] * (v.dim() - 1))) for k, v in one.items()}
    spec = spec_for("dpsgd", clip_norm=0.1)
    g3, g7 = (
        private_gradient(
            loss_fn, params, batch, spec=spec, generator=make_generator(1, "cpu")[0], basis=None
        )
        for batch in (three, seven)
    )
    clipped_one, _, _ = clipped_grad_sum(loss_fn, params, one, clip_norm=0.1, chunk_size=1)
    # same noise, so the difference is 4 clipped gradients over B = 5, not over 3 or 7
    torch.testing.assert_close(
        flat_vector(g7) - flat_vector(g3), 4 * flat_vector(clipped_one) / 5.0, rtol=1e-4, atol=1e-6
    )
    _, info = dp_gradient(
        loss_fn, params, spec=spec, private_batch=three, psi_batch=None,
        generator=make_generator(1, "cpu")[0], basis=None,
    )
    assert info["batch_size"] == 3 and info["expected_batch"] == pytest.approx(5.0)
    assert info["noise_std"] == pytest.approx(1.3 * 0.1 / 5.0)
    assert info["clipped_fraction"] == 1.0  # C = 0.1 is below this sample's norm


def dyadic_images(size: int, seed: int) -> torch.Tensor:
    """Pixel values k/64: block sums are exact in float32, so pixel order cannot matter."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 65, (size, 3, H, W), generator=gen).float() / 64


def permute_within_blocks(images: torch.Tensor, block: int) -> torch.Tensor:
    """Reverse the pixel order inside every block x block cell."""
    b, c, h, w = images.shape
    cells = images.view(b, c, h // block, block, w // block, block)
    flipped = cells.flip(3).flip(5)
    return flipped.reshape(b, c, h, w).contiguous()


@pytest.mark.invariant("P3")
def test_p3_public_gradient_depends_on_x_only_through_psi(toy):
    loss_fn, params = toy
    psi = Pixelate(block_size=4)
    base = make_batch(4, seed=40)
    raw_one = {**base, "image": dyadic_images(4, seed=41)}
    raw_two = {**base, "image": permute_within_blocks(raw_one["image"], 4)}
    assert not torch.equal(raw_one["image"], raw_two["image"])
    psi_one, psi_two = apply_psi(psi, raw_one), apply_psi(psi, raw_two)
    assert torch.equal(psi_one.tensors["image"], psi_two.tensors["image"])
    g_one = public_gradient(loss_fn, params, psi_one)
    g_two = public_gradient(loss_fn, params, psi_two)
    assert all(torch.equal(g_one[n], g_two[n]) for n in params)  # bit-identical
    # the full fdp step too, with the same private batch and noise seed
    private = make_batch(3, seed=42)
    full_one, _ = dp_gradient(
        loss_fn, params, spec=spec_for("fdp"), private_batch=private, psi_batch=psi_one,
        generator=make_generator(3, "cpu")[0], basis=None,
    )
    full_two, _ = dp_gradient(
        loss_fn, params, spec=spec_for("fdp"), private_batch=private, psi_batch=psi_two,
        generator=make_generator(3, "cpu")[0], basis=None,
    )
    assert all(torch.equal(full_one[n], full_two[n]) for n in params)
    # ... while a change that psi does see changes g_pub (so the check above can fail)
    shifted = apply_psi(psi, {**base, "image": raw_one["image"].roll(1, dims=3)})
    g_shifted = public_gradient(loss_fn, params, shifted)
    assert not torch.equal(flat_vector(g_shifted), flat_vector(g_one))
    # raw batches are refused outright
    with pytest.raises(TypeError, match="PsiBatch"):
        public_gradient(loss_fn, params, raw_one)


def test_public_gradient_is_plain_mean_gradient_on_psi(toy):
    loss_fn, params = toy
    psi = GaussianBlur()
    raw = make_batch(5, seed=50)
    psi_batch = apply_psi(psi, raw)
    assert isinstance(psi_batch, PsiBatch) and psi_batch.psi_name == "gaussian_blur"
    assert torch.equal(psi_batch.tensors["joints"], raw["joints"])
    got = public_gradient(loss_fn, params, psi_batch)
    blurred = {**raw, "image": psi(raw["image"])}
    expected = loop_grads(loss_fn, params, blurred)
    for n in params:
        torch.testing.assert_close(got[n], expected[n].mean(0), rtol=1e-5, atol=1e-6)


def test_dp_gradient_combines_per_method(toy):
    loss_fn, params = toy
    private = make_batch(6, seed=60)
    psi_batch = apply_psi(GaussianBlur(), make_batch(4, seed=61))
    basis = compute_basis(loss_fn, params, make_batch(8, seed=62), k=3, chunk_size=8)
    public = public_gradient(loss_fn, params, psi_batch)

    def run(method, psi=None, v=None):
        return dp_gradient(
            loss_fn, params, spec=spec_for(method), private_batch=private, psi_batch=psi,
            generator=make_generator(11, "cpu")[0], basis=v,
        )

    def priv(method, v=None):
        return private_gradient(
            loss_fn, params, private, spec=spec_for(method),
            generator=make_generator(11, "cpu")[0], basis=v,
        )

    nonprivate, info = run("nonprivate")
    reference = mean_grad(loss_fn, params, private)
    loop_mean = {n: g.mean(0) for n, g in loop_grads(loss_fn, params, private).items()}
    for n in params:
        torch.testing.assert_close(nonprivate[n], loop_mean[n], rtol=1e-5, atol=1e-6)
        assert torch.equal(nonprivate[n], reference[n])
    assert info["noise_std"] == 0.0
    dpsgd, info = run("dpsgd")
    assert torch.equal(flat_vector(dpsgd), flat_vector(priv("dpsgd")))
    assert info["batch_size"] == 6 and info["max_norm"] >= info["mean_norm"] > 0
    proj, _ = run("proj", v=basis)
    assert torch.equal(flat_vector(proj), flat_vector(priv("proj", basis)))
    fdp, _ = run("fdp", psi=psi_batch)
    torch.testing.assert_close(flat_vector(fdp), flat_vector(priv("fdp")) + flat_vector(public))
    fpdp, info = run("fpdp", psi=psi_batch, v=basis)
    torch.testing.assert_close(flat_vector(fpdp), flat_vector(priv("fpdp", basis)) + flat_vector(public))
    assert info["public_batch_size"] == 4
    # the public part is not projected: fpdp - g_pub lies in span(V), fpdp does not
    private_part = flat_vector(fpdp) - flat_vector(public)
    assert (private_part - project(basis, private_part)).norm() < 1e-4 * private_part.norm()
    assert (flat_vector(fpdp) - project(basis, flat_vector(fpdp))).norm() > 1e-3


@pytest.mark.invariant("P14")
def test_a_public_gradient_that_is_not_finite_is_left_out_of_its_step(toy):
    """P14 for the public term: g_pub on psi(x) that holds a NaN or an inf anywhere is left out (public_zeroed 1)
    and the step is the private part alone; a finite one is added."""
    loss_fn, params = toy
    private = make_batch(5)
    basis = compute_basis(loss_fn, params, make_batch(6, seed=3), k=3, chunk_size=6)
    for method, v in (("fdp", None), ("fpdp", basis)):
        alone = private_gradient(loss_fn, params, private, spec=spec_for(method),
                                 generator=make_generator(4, "cpu")[0], basis=v)
        for bad in (float("nan"), float("inf"), -float("inf"), None):
            public = make_batch(3, seed=8)
            if bad is not None:
                public["joints"][1, 5, 0] = bad
            psi_batch = apply_psi(GaussianBlur(), public)
            step, info = dp_gradient(loss_fn, params, spec=spec_for(method), private_batch=private,
                                     psi_batch=psi_batch, generator=make_generator(4, "cpu")[0], basis=v)
            if bad is None:
                assert info["public_zeroed"] == 0
                torch.testing.assert_close(flat_vector(step), flat_vector(alone) + flat_vector(public_gradient(
                    loss_fn, params, psi_batch)))
            else:
                assert info["public_zeroed"] == 1, (method, bad)
                assert torch.equal(flat_vector(step), flat_vector(alone)), (method, bad)


def test_dp_gradient_refuses_missing_or_unused_inputs(toy):
    loss_fn, params = toy
    private = make_batch(3)
    psi_batch = apply_psi(GaussianBlur(), make_batch(2))
    basis = compute_basis(loss_fn, params, make_batch(4, seed=3), k=2, chunk_size=4)
    gen = make_generator(0, "cpu")[0]

    def run(method, psi=None, v=None):
        return dp_gradient(
            loss_fn, params, spec=spec_for(method), private_batch=private, psi_batch=psi,
            generator=gen, basis=v,
        )

    for method in ("proj", "fpdp"):
        with pytest.raises(ValueError, match="no basis"):
            run(method, psi=psi_batch if method == "fpdp" else None)
    for method in ("fdp", "fpdp"):
        with pytest.raises(ValueError, match="psi_batch is"):
            run(method, v=basis if method == "fpdp" else None)
    with pytest.raises(ValueError, match="does not project"):
        run("dpsgd", v=basis)
    with pytest.raises(ValueError, match="does not use psi"):
        run("dpsgd", psi=psi_batch)
    with pytest.raises(ValueError, match="p=.*trainable"):
        run("proj", v=basis[:-1])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"clip_norm": 0.0}, "clip_norm"),
        ({"clip_norm": -0.1}, "clip_norm"),
        ({"expected_batch": 0}, "expected_batch"),
        ({"sample_rate": 0.0}, "sample_rate"),
        ({"sample_rate": 1.2}, "sample_rate"),
        ({"sigma": 0.0}, "no privacy"),
        ({"method": "dp"}, "unknown"),
        ({"chunk_size": 0}, "chunk_size"),
    ],
)
def test_dpspec_validation(overrides, match):
    values = {"method": "dpsgd", **overrides}
    with pytest.raises(ValueError, match=match):
        spec_for(**values)


def test_dpspec_is_keyword_only():
    with pytest.raises(TypeError):
        DPSpec("dpsgd", 1.0, 1.0, 0.1, 10)  # type: ignore[misc]
    assert spec_for("nonprivate", sigma=0.0).projects is False


# ---------------------------------------------------------------- claims, P8


@pytest.mark.invariant("P8")
def test_claims_state_the_right_guarantee():
    for method in ("fdp", "fpdp"):
        text = privacy_claim(
            method=method, epsilon=0.8, delta=1e-5, psi="Gaussian blur", seeded=False,
            accountant="rdp",
        )
        assert "(eps=0.8, delta=1e-05)-Feature-DP" in text
        assert "psi(x)" in text and "pose labels are treated as public" in text
        assert "not record-level DP" in text and "Gaussian blur" in text
    for method in ("dpsgd", "proj"):
        text = privacy_claim(
            method=method, epsilon=2.0, delta=1e-5, psi=None, seeded=False, accountant="prv"
        )
        assert text.startswith("record-level (eps=2, delta=1e-05)-DP per site")
        assert "Feature" not in text and "Poisson" in text and "add/remove" in text
        assert "PRV" in text
    assert "public data only" in privacy_claim(
        method="proj", epsilon=1.0, delta=1e-5, psi=None, seeded=False, accountant="rdp"
    )
    text = privacy_claim(
        method="nonprivate", epsilon=None, delta=None, psi=None, seeded=False, accountant="rdp"
    )
    assert text.startswith("no privacy guarantee")
    seeded = privacy_claim(
        method="dpsgd", epsilon=1.0, delta=1e-5, psi=None, seeded=True, accountant="rdp"
    )
    assert seeded.endswith("seeded noise: not for production")
    with pytest.raises(ValueError, match="psi"):
        privacy_claim(
            method="fdp", epsilon=1.0, delta=1e-5, psi=None, seeded=False, accountant="rdp"
        )
    with pytest.raises(ValueError, match="epsilon and delta"):
        privacy_claim(
            method="dpsgd", epsilon=None, delta=1e-5, psi=None, seeded=False, accountant="rdp"
        )


def test_compute_basis_keeps_the_public_rank_when_it_is_below_k(toy, caplog):
    """Training can leave the public per-sample gradients with fewer than k numerically independent directions
    (the shipped proj recipe did, past ~500 steps on larger wards). V then holds the genuine directions only, with
    a warning, instead of ending the run: V is public and applied after the noise, so its width changes the
    accuracy, never the privacy claim."""
    loss_fn, params = toy
    twice = {name: torch.cat([value, value, value]) for name, value in make_batch(2, seed=10).items()}  # rank 2
    with caplog.at_level(logging.WARNING, logger="fedpose.shared.privacy.step.subspace"):
        basis = compute_basis(loss_fn, params, twice, k=4, chunk_size=4)
    assert basis.shape == (sum(v.numel() for v in params.values()), 2)
    check_orthonormal(basis)
    matrix = flat_vector_per_sample(loop_grads(loss_fn, params, twice)).double()  # (6, p)
    svd_u = torch.linalg.svd(matrix.T, full_matrices=False)[0][:, :2]
    torch.testing.assert_close(projector(basis), svd_u @ svd_u.T, rtol=0, atol=1e-4)
    assert "numerical rank 2 < k=4" in caplog.text and "2 directions" in caplog.text
    with pytest.raises(ValueError, match="numerical rank 2"):  # asked for exactly k, it still refuses
        projection_basis(matrix.float(), 3)
