"""The pose model and pose batches for the per-sample gradient tests, and a local training run that records
every private step it takes (what the record-level and raw+psi tests hold to their recipes)."""

from __future__ import annotations

import torch

from fedpose.shared.configuration.schema import ModelConfig
from fedpose.shared.model.pose_loss import make_loss_fn
from fedpose.shared.model.posenet import build_model
from fedpose.shared.model.strategy import apply_strategy

INPUT = (64, 48)


def perturbed_model(variant: str, *, task_uncertainty: bool = True, seed: int = 0):
    """The pose model with its weights away from their init (zero biases, unit norms), so every rule is exercised."""
    torch.manual_seed(seed)
    model = build_model(ModelConfig(variant=variant, task_uncertainty=task_uncertainty), INPUT)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def pose_batch(size: int, seed: int) -> dict[str, torch.Tensor]:
    """``size`` random images of INPUT with random joints, about 80 % of them visible."""
    h, w = INPUT
    gen = torch.Generator().manual_seed(seed)
    return {
        "image": torch.rand(size, 3, h, w, generator=gen),
        "joints": torch.rand(size, 16, 2, generator=gen) * torch.tensor([w - 1.0, h - 1.0]),
        "visible": (torch.rand(size, 16, generator=gen) > 0.2).float(),
    }


def model_setup(variant: str, strategy: str, *, task_uncertainty: bool = True, seed: int = 0, size: int = 5):
    model = perturbed_model(variant, task_uncertainty=task_uncertainty, seed=seed)
    trainable = apply_strategy(model, strategy)
    named = dict(model.named_parameters())
    params = {n: named[n].detach() for n in trainable}
    return model, make_loss_fn(model, trainable), params, pose_batch(size, seed + 1)


def generic_loss(loss_fn):
    return lambda params, batch: loss_fn(params, batch)  # hides the model: the vmap(grad) path


def record_loop(loss_fn, params, batch, copies: int, clip: float) -> torch.Tensor:
    """Reference: per record, the gradient of each of its K copies by its own autograd call, their mean, clipped."""
    from fedpose.shared.privacy.step.subspace import flat_vector

    rows = batch["image"].shape[0]
    total = None
    for record in range(rows // copies):
        per_copy = []
        for row in range(record * copies, (record + 1) * copies):
            leaves = {n: p.clone().requires_grad_(True) for n, p in params.items()}
            loss = loss_fn(leaves, {k: v[row:row + 1] for k, v in batch.items()}).sum()
            per_copy.append(flat_vector(dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))))
        mean = torch.stack(per_copy).mean(0)
        clipped = mean * min(1.0, clip / (float(mean.norm()) + 1e-6))
        total = clipped if total is None else total + clipped
    return total


def recorded_train(cfg, steps, seen, monkeypatch, *, seed=0, public=False):
    import fedpose.shared.training.loop as step_module
    from fedpose.shared.privacy.step import fpdp
    import fedpose.shared.training.batches as batches
    import fedpose.shared.training.loop as train_module
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.privacy.step.noise import make_generator
    from fedpose.shared.training.runs import initial_model

    real_step = fpdp.dp_gradient

    def step(loss_fn, params, *, spec, private_batch, groups=None, **kwargs):
        seen.append((spec, private_batch["image"].clone(), groups, kwargs.get("scales")))
        return real_step(loss_fn, params, spec=spec, private_batch=private_batch, groups=groups, **kwargs)

    monkeypatch.setattr(step_module, "dp_gradient", step)
    dataset = batches.make_dataset(load_split(cfg.data.root, "site-0"), cfg, train=True, seed=seed)
    model = initial_model(cfg, progress=False)
    local_data = train_module.LocalData(dataset, public=batches.make_dataset(
        load_split(cfg.data.root, cfg.data.public_split), cfg, train=False) if public else None)
    local_run = train_module.LocalRun(train_module.step_spec(cfg.train.method, cfg.train, cfg.privacy, sigma=1.0,
                                      data=local_data), steps, cfg.train, cfg.privacy)
    result = train_module.local_train(model, local_data, local_run, generator=make_generator(seed)[0], bar=None)
    return model, result

