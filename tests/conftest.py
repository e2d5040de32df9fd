"""Fixtures shared by several test files: the tiny world at three depths, and the toy pose model.

The harnesses live in tests/support/ (``from support.federation import ...``): pytest puts this folder on
``sys.path`` (tests/ has no ``__init__.py``; prepend import mode, pytest's default), so test files and this
conftest import them as the top-level package ``support``. A subprocess that imports a harness gets tests/ on
its own path (benchmarks/deploy_round.py) or runs it as a script (tests/support/hostile_server.py).

The world fixtures are module-scoped, as each test file had them: the data and pretrained weights are
generated once per session (``support.federation.world_root``), the config and weights once per module.
"""

from __future__ import annotations

import pytest

from support.federation import prepare_world, world_root


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tiny world's config, its data generated and its pretrained weights cached."""
    return prepare_world(world_root(tmp_path_factory))


@pytest.fixture(scope="module")
def world_weights(world):
    """(cfg, state): the tiny world and its initial model's weights (a state dict of clones)."""
    from fedpose.shared.training.runs import initial_model

    return world, {k: v.clone() for k, v in initial_model(world, progress=False).state_dict().items()}


@pytest.fixture(scope="module")
def world_trainable(world):
    """(cfg, state, trainable, p): the tiny world, its initial weights, the names its strategy trains in a
    record-level round (dpsgd, proj: the task-uncertainty weights stay at their public values) and how many
    numbers they hold (the width of a basis)."""
    from fedpose.shared.model.strategy import apply_strategy
    from fedpose.shared.training.runs import initial_model

    model = initial_model(world, progress=False)
    trainable = apply_strategy(model, world.train.strategy, fixed_tasks=True)
    named = dict(model.named_parameters())
    p = sum(named[n].numel() for n in trainable)
    return world, {k: v.clone() for k, v in model.state_dict().items()}, trainable, p


@pytest.fixture
def toy_pose():
    """(loss_fn, params): the toy pose model (support.toy) with every parameter trainable, its per-record loss
    (the mean squared error over the visible joints)."""
    import torch
    from torch.func import functional_call

    from support.toy import ToyPose

    torch.manual_seed(0)
    model = ToyPose()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}

    def loss_fn(p, batch):
        pred = functional_call(model, p, (batch["image"],))  # (B, 16, 2)
        err = ((pred - batch["joints"]) ** 2).sum(-1) * batch["visible"]  # (B, 16)
        return err.sum(1) / batch["visible"].sum(1).clamp(min=1.0)  # (B,)

    return loss_fn, params
