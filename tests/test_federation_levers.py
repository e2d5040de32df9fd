"""Levers that make a DP federation learn: the server optimizer and the site's kept optimizer state.

Both are post-processing of DP outputs: nothing here changes what a site's accountant counts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedpose.client.policy import min_sigma_for, policy_from_dict
from fedpose.client.site import handle_train
from fedpose.server.aggregate import ServerOptimizer, aggregate, server_optimizer
from fedpose.shared.errors import ConfigError
from fedpose.shared.configuration.schema import replace
from fedpose.shared.flower.messages import ARRAYS, CONFIG, TrainRequest, weights_record
from fedpose.client.optim_state import load_state, save_state, state_path


def _w(*values: float) -> dict[str, torch.Tensor]:
    return {"a": torch.tensor(list(values), dtype=torch.float32)}


# ---------------------------------------------------------------------------
# server optimizer
# ---------------------------------------------------------------------------


def test_none_is_plain_fedavg():
    avg = aggregate([_w(1.0, 2.0), _w(3.0, 6.0)], "mean")
    assert torch.equal(avg["a"], torch.tensor([2.0, 4.0]))
    out = ServerOptimizer("none").apply(_w(0.0, 0.0), avg)
    assert torch.equal(out["a"], avg["a"])


def test_momentum_matches_a_hand_computation():
    opt = ServerOptimizer("momentum", lr=0.5, momentum=0.9)
    w = _w(1.0, -1.0)
    # round 1: d = a - w = (1, 2); m = d; w = w + 0.5 m = (1.5, 0)
    w = opt.apply(w, _w(2.0, 1.0))
    assert torch.allclose(w["a"], torch.tensor([1.5, 0.0]))
    # round 2: d = (0.5, -1); m = 0.9 (1, 2) + d = (1.4, 0.8); w = (1.5 + 0.7, 0 + 0.4)
    w = opt.apply(w, _w(2.0, -1.0))
    assert torch.allclose(w["a"], torch.tensor([2.2, 0.4]))


def test_momentum_zero_with_lr_one_is_fedavg():
    opt = ServerOptimizer("momentum", lr=1.0, momentum=0.0)
    w = _w(1.0, 2.0)
    for target in (_w(3.0, -1.0), _w(0.5, 0.5)):
        w = opt.apply(w, target)
        assert torch.allclose(w["a"], target["a"])


def test_adam_matches_a_hand_computation():
    opt = ServerOptimizer("adam", lr=0.1, betas=(0.9, 0.99), tau=1e-3)
    w = opt.apply(_w(0.0), _w(2.0))  # d = 2: m = 0.2, v = 0.04, step = 0.2 / (0.2 + 1e-3)
    assert w["a"].item() == pytest.approx(0.1 * 0.2 / (0.2 + 1e-3), rel=1e-6)
    w0 = w["a"].item()
    w = opt.apply(w, _w(w0 - 1.0))  # d = -1: m = 0.18 - 0.1 = 0.08, v = 0.0396 + 0.01 = 0.0496
    assert w["a"].item() == pytest.approx(w0 + 0.1 * 0.08 / (0.0496 ** 0.5 + 1e-3), rel=1e-5)


def test_server_optimizer_state_refuses_another_kind_and_config_validates(world_weights):
    opt = ServerOptimizer("momentum")
    opt.apply(_w(0.0), _w(1.0))
    with pytest.raises(ValueError, match="momentum"):
        ServerOptimizer("adam").load_state_dict(opt.state_dict())
    with pytest.raises(ValueError):
        ServerOptimizer("sgd")
    cfg, _ = world_weights
    assert server_optimizer(cfg).kind == "none"
    with pytest.raises(ConfigError, match="server_lr"):
        replace(cfg, **{"federation.server_lr": 0.0})
    with pytest.raises(ConfigError, match="site_optimizer"):
        replace(cfg, **{"federation.site_optimizer": "sometimes"})


# ---------------------------------------------------------------------------
# site optimizer state
# ---------------------------------------------------------------------------


def _adam_after_steps(params, steps: int) -> torch.optim.Adam:
    opt = torch.optim.Adam(params, lr=0.1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    return opt


def test_state_round_trip_and_refusals(tmp_path):
    params = [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(4))]
    opt = _adam_after_steps(params, 3)
    path = state_path(tmp_path / "ledger.sqlite", "fed/1")
    assert path == tmp_path / "optimizer" / "fed_1.pt"
    save_state(path, opt, params, "adam")
    assert sorted(p.name for p in path.parent.iterdir()) == ["fed_1.pt"]  # no temp file left

    fresh = torch.optim.Adam(params, lr=0.1)
    assert load_state(path, fresh, params, "adam")
    for p in params:
        a, b = opt.state[p], fresh.state[p]
        assert float(a["step"]) == float(b["step"]) == 3.0
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])

    assert not load_state(tmp_path / "none.pt", torch.optim.Adam(params), params, "adam")
    other = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError, match="shapes"):
        load_state(path, torch.optim.Adam(other), other, "adam")
    with pytest.raises(ValueError, match="'adam'"):
        load_state(path, torch.optim.SGD(params, lr=0.1), params, "sgd")


def _policy(cfg, tmp_path, *, rounds: int):
    """The tiny world's site-0 under a policy that pins this config's mechanism, its checks run."""
    from fedpose.client.data import load_split_dir, prepare_site
    from fedpose.shared.data.split import manifest_digest as public_digest

    root = Path(cfg.data.root)
    policy = policy_from_dict({
        "policy_version": 3, "site": "site-0", "epsilon": 2.0, "delta": 1e-3, "lifetime_rounds": rounds,
        "rounds_per_federation": rounds, "sample_rate": min(1.0, cfg.train.batch_size / 40),
        "expected_batch": float(cfg.train.batch_size), "steps_per_round": 2,
        "clip_norm": cfg.privacy.clip_norm, "psi": cfg.privacy.psi, "psi_min": cfg.privacy.psi_param,
        "augment": cfg.data.augment, "data_path": str(root / "site-0"), "ledger_path": str(tmp_path / "ledger.sqlite"),
        "public_path": str(root / "public"), "public_digest": public_digest(load_split_dir(root / "public", "public")),
        "release_blurred_images_and_labels": True, "public_batch_size": cfg.train.public_batch_size,
    })
    prepare_site(policy)
    return policy


def _content(cfg, state, *, sigma: float, round: int):
    from flwr.app import RecordDict

    request = TrainRequest(federation="fed-keep", round=round, site="site-0", sigma=sigma,
                           sample_rate=min(1.0, cfg.train.batch_size / 40), steps=2, basis_version=0,
                           basis_mode="broadcast", config=cfg)
    return RecordDict({ARRAYS: weights_record(state), CONFIG: request.to_record()})


def test_site_keeps_its_optimizer_state_across_rounds(world_weights, tmp_path):
    cfg, state = world_weights
    cfg = replace(cfg, **{"train.method": "dpsgd", "federation.site_optimizer": "keep"})
    policy = _policy(cfg, tmp_path, rounds=2)
    sigma = min_sigma_for(policy)
    path = state_path(policy.ledger_path, "fed-keep")

    handle_train(_content(cfg, state, sigma=sigma, round=1), policy)
    blob = torch.load(path, weights_only=True)
    steps = {float(s["step"]) for s in blob["state"]["state"].values()}
    assert steps == {2.0}
    handle_train(_content(cfg, state, sigma=sigma, round=2), policy)
    blob = torch.load(path, weights_only=True)
    assert {float(s["step"]) for s in blob["state"]["state"].values()} == {4.0}  # continued, not restarted


def test_fresh_site_optimizer_writes_no_state(world_weights, tmp_path):
    cfg, state = world_weights
    cfg = replace(cfg, **{"train.method": "dpsgd", "federation.site_optimizer": "fresh"})
    policy = _policy(cfg, tmp_path, rounds=1)
    sigma = min_sigma_for(policy)
    handle_train(_content(cfg, state, sigma=sigma, round=1), policy)
    assert not (tmp_path / "optimizer").exists()


def test_a_resumed_server_takes_the_same_fedadam_step_as_one_that_never_stopped(tmp_path):
    """The server optimizer's moments travel in the server checkpoint (issue #9): resuming does not reset them."""
    from fedpose.server.checkpoint import ServerState
    from fedpose.server.checkpoint import load_state as load_server_state
    from fedpose.server.checkpoint import save_state as save_server_state

    gen = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(4, 3, generator=gen), "b": torch.randn(5, generator=gen)}
    averages = [{k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in w.items()} for _ in range(3)]
    running = ServerOptimizer("adam", lr=0.05)
    w1 = running.apply(w, averages[0])
    w2 = running.apply(w1, averages[1])
    save_server_state(tmp_path / "checkpoint.pt", ServerState(round=2, federation="f", weights=w2, ledger={},
                                                              history=[], optimizer=running.state_dict()))
    state = load_server_state(tmp_path / "checkpoint.pt")
    resumed = ServerOptimizer("adam", lr=0.05)
    resumed.load_state_dict(state.optimizer)
    expected = running.apply(w2, averages[2])
    got = resumed.apply(state.weights, averages[2])
    fresh = ServerOptimizer("adam", lr=0.05).apply(w2, averages[2])
    for name in w:
        assert torch.equal(got[name], expected[name])
        assert not torch.allclose(fresh[name], expected[name])  # what a reset would have done instead
