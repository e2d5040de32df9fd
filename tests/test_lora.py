"""Low-rank adapters (``train.strategy: lora``): the adapted model starts as the pretrained one, the per-sample
paths clip the adapters exactly as the per-example loop does, a run trains only the adapters and the heads and
hands back a plain PoseNet with U D folded into the trunk's linear layers, and a federation refuses the strategy.
"""

from __future__ import annotations

import pytest
import torch

from support.models import perturbed_model, pose_batch, record_loop, recorded_train


def _model():
    return perturbed_model("tinyvit-5m").eval()


def _train_up(model) -> None:
    """U away from zero, as after training (D then has a gradient too)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora.up.weight"):
                p.copy_(0.1 * torch.randn_like(p))


def _outputs(model, images):
    with torch.no_grad():
        out = model(images)
    return [t.clone() for t in (out.values() if isinstance(out, dict) else out)]


def test_adapters_start_as_the_pretrained_model_and_merge_into_the_function_they_computed():
    from fedpose.shared.model.lora import adapted_layers, add_adapters, has_adapters, merge_adapters

    model = _model()
    names_before = [n for n, _ in model.named_parameters()]
    images = pose_batch(3, seed=1)["image"]
    before = _outputs(model, images)
    layers = adapted_layers(model)
    added = add_adapters(model, 2, torch.Generator().manual_seed(0))
    assert len(layers) > 0 and len(added) == 2 * len(layers)
    assert all(name.startswith("stages.") and ".lora." in name for name in added)
    for got, want in zip(_outputs(model, images), before):  # U = 0: the start is the pretrained model
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    _train_up(model)
    adapted = _outputs(model, images)
    assert any(not torch.allclose(a, b) for a, b in zip(adapted, before))
    with pytest.raises(ValueError, match="already carries adapters"):
        add_adapters(model, 2, torch.Generator())
    assert merge_adapters(model) == len(layers)
    assert not has_adapters(model) and [n for n, _ in model.named_parameters()] == names_before
    for got, want in zip(_outputs(model, images), adapted):  # W + U D computes what the adapter did
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_lora_trains_the_adapters_and_the_heads_and_needs_adapters_on_the_model():
    from fedpose.shared.model.lora import add_adapters
    from fedpose.shared.model.posenet import TASK_SCALE
    from fedpose.shared.model.strategy import apply_strategy, trainable_names

    model = _model()
    with pytest.raises(ValueError, match="carries none"):  # a server or a site: whole weights, no adapters
        trainable_names(model, "lora")
    adapters = add_adapters(model, 4, torch.Generator().manual_seed(0))
    trained = apply_strategy(model, "lora")
    heads = [n for n, _ in model.named_parameters() if n.startswith("head.") and n != TASK_SCALE]
    assert set(trained) == set(adapters) | set(heads) and TASK_SCALE not in trained
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(trained)
    with pytest.raises(ValueError, match="lora_rank=999 exceeds"):
        add_adapters(_model(), 999, torch.Generator())


def test_the_adapters_per_sample_gradients_are_clipped_as_by_the_per_example_loop():
    from fedpose.shared.model.lora import add_adapters
    from fedpose.shared.model.pose_loss import make_loss_fn
    from fedpose.shared.model.strategy import apply_strategy
    from fedpose.shared.privacy.step import bookkeeping
    from fedpose.shared.privacy.step.fpdp import clipped_grad_sum
    from fedpose.shared.privacy.step.subspace import flat_vector

    model = _model()
    add_adapters(model, 2, torch.Generator().manual_seed(0))
    _train_up(model)
    trainable = apply_strategy(model, "lora")
    named = dict(model.named_parameters())
    params = {n: named[n].detach() for n in trainable}
    loss_fn = make_loss_fn(model, trainable)
    batch = pose_batch(4, seed=1)
    assert bookkeeping.supports(loss_fn, params)  # the fast path covers the adapters
    # the per-example loop: one autograd call per record
    norms = torch.stack([record_loop(loss_fn, params, {k: v[row:row + 1] for k, v in batch.items()}, 1,
                                      clip=1e9).norm() for row in range(4)])
    clip = float(norms.median())
    want = record_loop(loss_fn, params, batch, 1, clip=clip)
    for fn in (loss_fn, lambda p, b: loss_fn(p, b)):  # book-keeping, then the generic vmap(grad) path
        got = clipped_grad_sum(fn, params, batch, clip_norm=clip, chunk_size=3)
        torch.testing.assert_close(got.norms.float(), norms, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(flat_vector(got.summed), want, rtol=2e-4, atol=1e-6)
    assert any(float(n) > clip for n in norms), "the test must clip some records"


def test_a_lora_run_hands_back_a_plain_posenet_with_only_the_linear_layers_and_heads_moved(world, monkeypatch):
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.model.lora import adapted_layers, has_adapters
    from fedpose.shared.model.posenet import TASK_SCALE
    from fedpose.shared.training.runs import initial_model

    cfg = replace(world, **{"train.method": "dpsgd", "train.batch_size": 4, "train.strategy": "lora",
                            "train.lora_rank": 2, "train.lr": 1e-2, "train.schedule": "constant"})
    start_model = initial_model(cfg, progress=False)
    start = {n: p.detach().clone() for n, p in start_model.named_parameters()}
    layers = {f"{name}.weight" for name in adapted_layers(start_model)}
    model, result = recorded_train(cfg, 3, [], monkeypatch)
    assert not has_adapters(model) and set(dict(model.named_parameters())) == set(start)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), start[n])}
    heads = {n for n in start if n.startswith("head.") and n != TASK_SCALE}
    assert moved & layers and moved <= layers | heads
    for name in layers & moved:  # each trunk layer moved by U D: a matrix of rank <= 2
        delta = dict(model.named_parameters())[name].detach() - start[name]
        assert int(torch.linalg.matrix_rank(delta.double(), rtol=1e-6)) <= 2
    assert result.steps == 3 and result.sigma == 1.0  # the accountant's input: what ran, adapters or not


def test_a_lora_run_refuses_a_basis_or_optimizer_from_elsewhere(world):
    from fedpose.shared.configuration.schema import replace
    import fedpose.shared.training.batches as batches
    import fedpose.shared.training.loop as loop
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.model.lora import has_adapters
    from fedpose.shared.training.runs import initial_model

    cfg = replace(world, **{"train.method": "proj", "train.strategy": "lora"})
    model = initial_model(cfg, progress=False)
    data = loop.LocalData(batches.make_dataset(load_split(cfg.data.root, "site-0"), cfg, train=True, seed=0))
    run = loop.LocalRun(loop.step_spec("proj", cfg.train, cfg.privacy, sigma=1.0, data=data), 1, cfg.train,
                        cfg.privacy)
    with pytest.raises(ValueError, match="centralized only"):
        loop.local_train(model, data, run, generator=torch.Generator().manual_seed(0),
                         basis=torch.zeros(10, 2), bar=None)
    assert not has_adapters(model)


def test_config_checks_the_rank():
    from fedpose.shared.errors import ConfigError
    from fedpose.shared.configuration.schema import config_from_dict

    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="lora_rank"):
            config_from_dict({"train": {"lora_rank": bad}})
