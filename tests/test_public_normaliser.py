"""P15: the normaliser and every scale applied to the noisy sum are public constants pinned by the site's policy.

Before, a site divided its noisy sum by q n with its real n, and the server may choose plain SGD: one
reply's spread, sigma C / (q n), gave n to 0.1 %. Here two sites of different size under the same
policy must send updates of the same spread, sigma C / B, whatever their n. Through the real site path.
"""

from __future__ import annotations

import pytest
import torch

from fedpose.client.site import handle_train
from fedpose.shared.configuration.schema import replace
from fedpose.shared.flower.messages import ARRAYS, record_tensors
from support.site import site_policy, subset_split, train_request


def _spread(cfg, state, policy, sigma: float) -> float:
    sgd = replace(cfg, **{"train.optimizer": "sgd", "train.lr": 1.0, "train.momentum": 0.0,
                          "train.weight_decay": 0.0, "train.schedule": "constant"})
    reply = record_tensors(handle_train(train_request(sgd, state, sigma=sigma, steps=1), policy)[ARRAYS])
    update = torch.cat([(reply[k].double() - state[k].double()).flatten() for k in sorted(reply)])
    return float(update.std())


@pytest.mark.invariant("P15")
def test_the_update_spread_is_sigma_c_over_the_declared_batch_whatever_n(world_weights, tmp_path):
    cfg, state = world_weights
    spreads = {}
    for n in (40, 20):
        data = subset_split(cfg, tmp_path / f"n{n}" / "site-0", n)
        policy = site_policy(cfg, tmp_path / f"n{n}", data_path=str(data), sample_rate=0.2, expected_batch=8.0,
                         seed=5, min_sigma=1.0, epsilon=1e6)
        sigma = 50.0  # the noise dominates the clipped sum, so the spread reads off the normaliser
        spreads[n] = _spread(cfg, state, policy, sigma)
        assert spreads[n] == pytest.approx(sigma * policy.clip_norm / 8.0, rel=0.03)
    # before: sigma C / (q n) = 50 / 8 and 50 / 4, twice the spread at half the records
    assert spreads[40] == pytest.approx(spreads[20], rel=0.03)
