"""The private step's chunk sized from the device's free memory (``privacy.chunk_memory``, a site's policy
``chunk_memory``): the largest chunk whose measured peak fits the allowance, never above ``chunk_size``, which
stays the cap; decided once from the model, the input size and the machine, never from the realised batch; the
step's result does not depend on it; and a request cannot raise what a site allows.

Measured for real on this CPU (``device=cpu``, the code path a GPU site runs; there torch's allocator gives the
peak): the peak of a blank chunk of the pose model, against a real allowance in bytes.
"""

from __future__ import annotations

import logging

import pytest
import torch

from fedpose.shared.configuration.schema import replace
from fedpose.shared.errors import ConfigError
from fedpose.shared.privacy.step.fpdp import DPSpec, clipped_grad_sum, dp_gradient
from fedpose.shared.training.chunk_memory import blank_chunk, choose_chunk_size, chunk_for, measured_peak
from support.models import INPUT, model_setup, pose_batch

CAP = 8


def _measure(model, trainable, input_size=INPUT):
    """rows -> the measured peak of one padded blank chunk of ``model`` at that many rows (bytes)."""
    device = next(model.parameters()).device
    return lambda rows: measured_peak(blank_chunk(model, trainable, input_size=input_size, face_tasks=(),
                                                  chunk_size=rows, grouped=False), device)


@pytest.fixture(scope="module")
def pose():
    model, loss_fn, params, _ = model_setup("tinyvit-5m", "finetune")
    return model, loss_fn, params, list(params)


def test_the_measured_peak_of_a_chunk_grows_with_its_rows_and_is_the_same_when_measured_again(pose):
    model, _, _, trainable = pose
    measure = _measure(model, trainable)
    one, two, four = measure(1), measure(2), measure(4)
    assert 0 < one < two < four
    assert measure(2) == two  # the live tensors' peak, not the process's resident set: warm or cold alike


def test_a_roomy_allowance_chooses_the_cap_and_never_more(pose):
    model, _, _, trainable = pose
    choice = chunk_for(model, trainable, input_size=INPUT, face_tasks=(), grouped=False, cap=CAP, fraction=0.5)
    assert choice.size == CAP and choice.cap == CAP  # this machine has far more than 8 rows' worth free
    assert 0 < choice.peak_bytes <= choice.budget_bytes
    assert chunk_for(model, trainable, input_size=INPUT, face_tasks=(), grouped=False, cap=3,
                     fraction=0.5).size == 3


def test_a_smaller_allowance_chooses_a_smaller_chunk_that_fits_it(pose):
    model, _, _, trainable = pose
    measure = _measure(model, trainable)
    at_cap = measure(CAP)
    budget = (measure(1) + at_cap) // 2  # room for some rows, not for the cap's
    choice = choose_chunk_size(measure, cap=CAP, budget_bytes=budget)
    assert 1 <= choice.size < CAP
    assert choice.peak_bytes == measure(choice.size) <= budget  # measured at the size chosen, and it fits
    assert measure(choice.size + 1) > budget  # the largest that fits
    with pytest.raises(ValueError, match="one row"):
        choose_chunk_size(measure, cap=CAP, budget_bytes=measure(1) // 2)


@pytest.mark.invariant("P13")
def test_the_chosen_chunk_runs_every_realised_batch_on_the_same_rows_and_the_same_peak(pose):
    model, loss_fn, params, trainable = pose
    measure = _measure(model, trainable)
    chosen = choose_chunk_size(measure, cap=CAP, budget_bytes=(measure(1) + measure(CAP)) // 2).size
    seen: list[int] = []
    handle = model.register_forward_pre_hook(lambda module, args: seen.append(int(args[0].shape[0])))
    peaks = []
    try:
        for size in (0, 1, chosen + 1, 3 * chosen):
            batch = pose_batch(size, seed=size)
            seen.clear()
            peaks.append(measured_peak(lambda: clipped_grad_sum(loss_fn, params, batch, clip_norm=0.05,
                                                                chunk_size=chosen, pad=True), torch.device("cpu")))
            assert seen and set(seen) == {chosen}, (size, seen)
    finally:
        handle.remove()
    # the chunk's tensors have one shape whatever the batch; only the norms' (b,) float64 and the chunk's slices
    # of the batch itself differ (bytes, against the chunk's megabytes)
    assert max(peaks) - min(peaks) <= 0.01 * max(peaks), peaks


def test_the_step_gives_the_same_result_whatever_chunk_is_chosen(pose):
    model, loss_fn, params, trainable = pose
    measure = _measure(model, trainable)
    small = choose_chunk_size(measure, cap=CAP, budget_bytes=(2 * measure(1) + measure(2)) // 3).size
    large = choose_chunk_size(measure, cap=CAP, budget_bytes=10 * measure(CAP)).size
    assert small < large == CAP
    batch = pose_batch(11, seed=3)
    results = []
    for chunk in (small, large):
        spec = DPSpec(method="dpsgd", clip_norm=0.05, sigma=1.0, sample_rate=0.1, expected_batch=10.0,
                      chunk_size=chunk, pad_chunks=True)
        grads, _ = dp_gradient(loss_fn, params, spec=spec, private_batch=batch, psi_batch=None,
                               generator=torch.Generator().manual_seed(7), basis=None)
        results.append(grads)
    for name in results[0]:
        assert torch.allclose(results[0][name], results[1][name], rtol=1e-4, atol=1e-6), name


def test_a_centralized_run_sizes_its_chunk_once_reports_it_and_trains_the_same_weights(world, tmp_path):
    from fedpose.shared.model.strategy import apply_train_strategy
    from fedpose.shared.training.chunk_memory import free_memory
    from fedpose.shared.training.runs import initial_model, run_train

    cfg = replace(world, **{"train.method": "dpsgd", "train.epochs": 1, "train.seed": 3, "privacy.chunk_size": CAP})
    model = initial_model(cfg, progress=False)
    trainable = apply_train_strategy(model, cfg.train)
    rows = _measure(model, trainable, cfg.data.input_size)
    share = (rows(1) + rows(CAP)) / 2 / free_memory(torch.device("cpu"))  # room for some rows, not for the cap's
    sized = run_train(replace(cfg, **{"privacy.chunk_memory": share}), tmp_path / "sized", progress=False)
    fixed = run_train(cfg, tmp_path / "fixed", progress=False)
    assert 1 <= sized["chunk_size"] < fixed["chunk_size"] == CAP
    assert sized["steps"] == fixed["steps"] and sized["sigma"] == fixed["sigma"]
    weights = [torch.load(tmp_path / run / "model.pt", weights_only=False)["state_dict"] for run in ("sized", "fixed")]
    for name, value in weights[1].items():
        assert torch.allclose(weights[0][name], value, rtol=1e-3, atol=1e-5), name


@pytest.mark.parametrize("value", [0, -0.5, 1.0, 1.5, float("nan")])
def test_the_memory_share_is_checked_where_the_config_is_read(world, value):
    assert replace(world, **{"privacy.chunk_memory": 0.8}).privacy.chunk_memory == 0.8
    with pytest.raises(ConfigError, match="privacy.chunk_memory"):
        replace(world, **{"privacy.chunk_memory": value})


@pytest.mark.parametrize("value", [0, 1.0, 2, True, "auto"])
def test_a_site_policys_memory_share_is_checked(world, tmp_path, value):
    from support.site import site_policy

    assert site_policy(world, tmp_path, prepare=False, chunk_memory=0.8).chunk_memory == 0.8
    with pytest.raises(ValueError, match="chunk_memory"):
        site_policy(world, tmp_path, prepare=False, chunk_memory=value)


@pytest.mark.invariant("P11", "P13")
def test_a_request_for_more_memory_than_the_site_allows_is_refused_with_nothing_spent(world_weights, tmp_path):
    from fedpose.client.policy import min_sigma_for
    from fedpose.shared.flower.messages import RefusalCode
    from support.site import refusal_of, site_policy, spend_rows, train_request

    cfg, state = world_weights
    fixed = site_policy(cfg, tmp_path / "fixed")  # no chunk_memory: every chunk is chunk_size rows
    asked = replace(cfg, **{"privacy.chunk_memory": 0.9, "privacy.chunk_size": 4 * fixed.chunk_size})
    refusal = refusal_of(train_request(asked, state, sigma=min_sigma_for(fixed)), fixed)
    assert refusal.code == RefusalCode.POLICY and "chunk_memory" in refusal.reason
    assert spend_rows(fixed) == []
    sized = site_policy(cfg, tmp_path / "sized", chunk_memory=0.5)
    refusal = refusal_of(train_request(asked, state, sigma=min_sigma_for(sized)), sized)
    assert refusal.code == RefusalCode.POLICY and "chunk_memory=0.5" in refusal.reason
    assert spend_rows(sized) == []


@pytest.mark.invariant("P13")
def test_a_site_sizes_its_chunk_under_its_own_cap_whatever_the_request_says(world_weights, tmp_path, caplog):
    from fedpose.client.policy import min_sigma_for
    from fedpose.client.site import handle_train
    from support.site import site_policy, spend_rows, train_request

    cfg, state = world_weights
    policy = site_policy(cfg, tmp_path, chunk_memory=0.5, chunk_size=3)
    asked = replace(cfg, **{"privacy.chunk_memory": 0.5, "privacy.chunk_size": 64})  # the request's cap is not read
    with caplog.at_level(logging.INFO):
        handle_train(train_request(asked, state, sigma=min_sigma_for(policy), steps=2), policy)
    assert [r["state"] for r in spend_rows(policy)] == ["done"]
    said = [r.getMessage() for r in caplog.records if "chunk of" in r.getMessage()]
    assert said and "chunk of 3 rows" in said[0] and "chunk_size=3" in said[0], said


def test_a_site_that_sizes_nothing_keeps_its_fixed_chunk_out_of_the_info_log(world_weights, tmp_path, caplog):
    """Without chunk_memory a site's chunk is its policy's chunk_size every round: nothing was chosen, so nothing is
    said at INFO (one line per site and round filled the main command's output); DEBUG still says it."""
    from fedpose.client.policy import min_sigma_for
    from fedpose.client.site import handle_train
    from support.site import site_policy, train_request

    cfg, state = world_weights
    policy = site_policy(cfg, tmp_path)
    assert policy.chunk_memory is None
    with caplog.at_level(logging.INFO):
        handle_train(train_request(cfg, state, sigma=min_sigma_for(policy), steps=2), policy)
    assert not [r for r in caplog.records if "chunk of" in r.getMessage()], caplog.text
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="fedpose.client.capacity"):
        handle_train(train_request(cfg, state, sigma=min_sigma_for(policy), steps=2, round=2), policy)
    said = [r for r in caplog.records if "chunk of" in r.getMessage()]
    assert said and said[0].levelno == logging.DEBUG and "not sized" in said[0].getMessage()


@pytest.mark.invariant("P11")
def test_a_simulations_sites_size_their_chunks_as_its_config_asks(world_weights, tmp_path):
    """The researcher's own simulation writes its sites' policies from the config: with privacy.chunk_memory they
    allow that share, at most the config's chunk_size, so its own requests are not refused; without it the
    policies are what they were (16 rows, no chunk_memory)."""
    from fedpose.client.policy import min_sigma_for
    from fedpose.client.policy_resolve import default_policy
    from fedpose.client.request import check_request, parse_request
    from support.site import train_request

    cfg, state = world_weights
    asked = replace(cfg, **{"privacy.chunk_memory": 0.6, "privacy.chunk_size": 24})
    policy = default_policy(asked, tmp_path / "sim", 0)
    assert (policy.chunk_memory, policy.chunk_size) == (0.6, 24)
    request = parse_request(train_request(asked, state, sigma=min_sigma_for(policy), site=policy.site,
                                          sample_rate=policy.sample_rate))
    check_request(request, policy)  # not refused
    plain = default_policy(cfg, tmp_path / "plain", 0)
    assert (plain.chunk_memory, plain.chunk_size) == (None, 16)
