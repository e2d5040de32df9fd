"""The local-training loop's learning-rate schedule, centralized and across federated rounds."""

from __future__ import annotations

import math

import pytest
import torch

from federation_support import prepare_world, world_root
from shared.config import replace
from shared.runs import initial_model, load_records
from shared.train import lr_factor, local_train, make_dataset, round_span


def test_cosine_decays_from_one_towards_zero_and_constant_stays():
    values = [lr_factor("cosine", s, 10) for s in range(10)]
    assert values[0] == 1.0
    assert all(a > b for a, b in zip(values, values[1:]))
    assert values[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.9)))
    assert all(lr_factor("constant", s, 10) == 1.0 for s in range(10))
    with pytest.raises(ValueError, match="outside the run"):
        lr_factor("cosine", 10, 10)


def test_round_spans_tile_the_federated_run():
    spans = [round_span(r, 5, 3) for r in (1, 2, 3)]
    assert spans == [(0, 15), (5, 15), (10, 15)]
    assert round_span(4, 5, 3) == (15, 20)  # a resumed server running past its plan
    with pytest.raises(ValueError):
        round_span(0, 5, 3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = prepare_world(world_root(tmp_path_factory))
    records = load_records(cfg.data.root, "site-0")
    return cfg, make_dataset(records, cfg, train=True, seed=0)


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_local_train_follows_the_schedule_within_its_span(tiny, schedule):
    cfg, dataset = tiny
    train = replace(cfg, **{"train.schedule": schedule, "train.lr": 0.01}).train
    model = initial_model(cfg, progress=False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=train.lr)
    local_train(model, dataset, method="nonprivate", train=train, privacy=cfg.privacy, sigma=0.0, steps=3,
                generator=torch.Generator().manual_seed(0), optimizer=opt, schedule_span=(5, 8), progress=False)
    # the last of the 3 steps is global step 7 of 8
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * lr_factor(schedule, 7, 8))
    with pytest.raises(ValueError, match="do not fit"):
        local_train(model, dataset, method="nonprivate", train=train, privacy=cfg.privacy, sigma=0.0, steps=3,
                    generator=torch.Generator().manual_seed(0), schedule_span=(6, 8), progress=False)
