"""train.optimizer: public-adam. Adam whose second moment comes from public data.

Under DP, Adam's second moment fills with the noise (sigma C / B per coordinate), so DP-Adam steps like SGD with one
rate for every coordinate. Here the first moment is the step's (DP) gradient and the second moment the running
mean of the squared mean gradient of a public batch at the current weights: Adam's per-coordinate conditioning,
read from public data only, post-processing of the private gradient (no privacy cost). Checked: given its public
gradient equal to the step's, it is Adam; its second moment does not depend on the private records; a site, which
holds no public split, refuses it with nothing spent.
"""

from __future__ import annotations

import pytest
import torch
from support.site import refusal_of, site_policy, spend_rows, train_request

from fedpose.client.policy import min_sigma_for

from fedpose.shared.configuration.schema import replace


def test_public_adam_fed_the_steps_own_gradient_as_its_public_one_is_adam():
    from fedpose.shared.training.public_adam import PublicAdam

    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(5, 4, generator=gen), torch.randn(7, generator=gen)]
    ours = [p.clone().requires_grad_(True) for p in start]
    theirs = [p.clone().requires_grad_(True) for p in start]
    opt = PublicAdam(ours, lr=0.01, eps=1e-8)
    ref = torch.optim.Adam(theirs, lr=0.01, eps=1e-8)
    for _ in range(6):
        grads = [torch.randn(p.shape, generator=gen) * 10 ** torch.randint(-3, 2, (1,), generator=gen).item()
                 for p in start]
        opt.observe_public(grads)
        for mine, other, g in zip(ours, theirs, grads):
            mine.grad, other.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for mine, other in zip(ours, theirs):
        torch.testing.assert_close(mine, other, rtol=1e-5, atol=1e-7)


def test_public_adam_refuses_a_step_without_its_public_gradient_and_bad_arguments():
    from fedpose.shared.training.public_adam import PublicAdam

    p = torch.zeros(3, requires_grad=True)
    opt = PublicAdam([p], lr=0.1)
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="observe_public"):
        opt.step()  # a step whose second moment would be stale or empty
    with pytest.raises(ValueError, match="one public gradient for each"):
        opt.observe_public([torch.ones(3), torch.ones(3)])
    with pytest.raises(ValueError, match="lr"):
        PublicAdam([p], lr=0.0)


@pytest.mark.invariant("P2")
def test_public_adams_second_moment_reads_public_data_only(world, tmp_path):
    """Two runs that differ only in their private records: after a step, their first moments differ (the private
    gradient) and their second moments are the same (the public split's gradient at the same weights)."""
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.model.strategy import apply_train_strategy
    from fedpose.shared.privacy.step.noise import make_generator
    from fedpose.shared.training import loop
    from fedpose.shared.training.batches import make_dataset
    from fedpose.shared.training.runs import initial_model
    from fedpose.shared.training.schedule import make_optimizer

    cfg = replace(world, **{"train.method": "dpsgd", "train.batch_size": 4, "train.optimizer": "public-adam",
                            "train.public_batch_size": 4})
    states = []
    for split in ("site-0", "site-1"):
        private = make_dataset(load_split(cfg.data.root, split), cfg, train=True, seed=0)
        public = make_dataset(load_split(cfg.data.root, cfg.data.public_split), cfg, train=False)
        data = loop.LocalData(private, public=public)
        model = initial_model(cfg, progress=False)
        names = apply_train_strategy(model, cfg.train)
        named = dict(model.named_parameters())
        opt = make_optimizer([named[n] for n in names], cfg.train)
        run = loop.LocalRun(loop.step_spec("dpsgd", cfg.train, cfg.privacy, sigma=1.0, data=data), 1, cfg.train,
                            cfg.privacy)
        loop.local_train(model, data, run, generator=make_generator(0)[0], optimizer=opt, bar=None)
        states.append([opt.state[named[n]] for n in names])
    first, second = states
    assert any(not torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in zip(first, second))
    for a, b in zip(first, second):
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"], rtol=0, atol=0)
    assert any(float(a["exp_avg_sq"].abs().sum()) > 0 for a in first)


def test_public_adam_needs_the_public_split(world, monkeypatch):
    from support.models import recorded_train

    cfg = replace(world, **{"train.method": "dpsgd", "train.batch_size": 4, "train.optimizer": "public-adam"})
    with pytest.raises(ValueError, match="public-adam.*public split"):
        recorded_train(cfg, 1, [], monkeypatch)


def test_a_request_for_public_adam_is_refused_with_nothing_spent(world_trainable, tmp_path):
    """A site holds no public split to read the second moment from: refused before anything is charged, and a
    federation will not start with it."""
    from fedpose.server.run import run_federation
    from fedpose.shared.errors import ConfigError
    from fedpose.shared.flower.messages import RefusalCode

    cfg, state, _, _ = world_trainable
    policy = site_policy(cfg, tmp_path)
    asked = replace(cfg, **{"train.optimizer": "public-adam"})
    refusal = refusal_of(train_request(asked, state, sigma=min_sigma_for(policy)), policy)
    assert refusal.code == RefusalCode.BAD_REQUEST and "public-adam" in refusal.reason
    assert spend_rows(policy) == []
    with pytest.raises(ConfigError, match="public-adam is for centralized runs only"):
        run_federation(None, asked, tmp_path / "never-written")
