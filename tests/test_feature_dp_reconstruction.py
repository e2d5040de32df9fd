"""P17 measured: what one Feature-DP reply gives a server that crafts the weights, and that a site which pins
the record-level methods gives it nothing.

Real files throughout: the tiny synthetic world, real SQLite ledgers, ``fedpose.client.site.handle_train``; the
server's side is ``fedpose.shared.experiments.reconstruction`` (crafted weights, V outside the read tensors) and
``fedpose.shared.experiments.reconstruction_read`` (the read-out and its score).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedpose.client.policy import min_sigma_for
from fedpose.client.site import handle_train
from fedpose.client.data import load_split_dir, site_info
from fedpose.shared.experiments.reconstruction import attack_config, attack_content, craft_weights, outside_basis
from fedpose.shared.experiments.reconstruction_read import (
    find_record,
    planes_of,
    psnr,
    public_gradient_of,
    read_reply,
    render,
    score,
)
from fedpose.shared.flower.messages import ARRAYS, Refusal, RefusalCode, record_tensors
from support.site import site_policy, q_of, spend_rows

# The read-out is exact up to float32 rounding (measured: about 130 dB, joints within 3e-7 px). 80 dB is an
# error of 1e-4 of the pixel range: far below what an eye or a face matcher resolves, and far above what
# any blend of records or a reply not read exactly reaches (other records of the ward score below 30 dB).
MIN_PSNR_DB = 80.0
MAX_LABEL_ERROR_PX = 1e-3


def _crafted(cfg):
    from fedpose.shared.model.posenet import build_model
    from fedpose.shared.model.strategy import apply_strategy

    model = build_model(cfg.model, cfg.data.input_size)
    crafted = craft_weights(model)
    trainable = apply_strategy(model, cfg.train.strategy)
    return crafted, outside_basis(model, trainable, crafted, cfg.privacy.k)


def _site_psi(cfg, policy):
    """Every record of the site's data: psi(x) of its canonical crop, as the public term sees it, and labels."""
    from fedpose.shared.training.batches import make_dataset, make_psi_from, psi_on

    records = load_split_dir(Path(policy.data_path), "site data")
    canonical = make_dataset(records, cfg, train=False)
    batch = canonical.batch(list(range(len(canonical))))
    psi = make_psi_from(cfg.privacy, torch.Generator().manual_seed(0))
    return psi_on(psi, batch, torch.device("cpu")).tensors


@pytest.mark.invariant("P17")
def test_one_fpdp_reply_gives_the_server_psi_of_the_drawn_record_and_its_exact_labels(world, tmp_path):
    cfg = attack_config(world)
    policy = site_policy(cfg, tmp_path, release_blurred_images_and_labels=True, public_batch_size=1)
    crafted, basis = _crafted(cfg)
    content = attack_content(cfg, crafted, basis, federation="fed-test", round=1, site="site-0",
                             sigma=min_sigma_for(policy), sample_rate=q_of(cfg))
    reply = handle_train(content, policy)
    assert [r["state"] for r in spend_rows(policy)] == ["done"]  # an ordinary, charged round

    grads = public_gradient_of(crafted.state, record_tensors(reply[ARRAYS]), crafted.read, lr=cfg.train.lr)
    readout = read_reply(crafted, grads, cfg.model, public_batch_size=cfg.train.public_batch_size)
    site = _site_psi(cfg, policy)
    index, label_error = find_record(readout, site["joints"], site["visible"])
    measured = score(readout, site["image"][index], site["joints"][index], site["visible"][index])
    assert label_error <= MAX_LABEL_ERROR_PX and measured.label_error_px == label_error
    assert measured.visibility_match and measured.visible_joints > 0
    assert measured.psnr_db >= MIN_PSNR_DB, measured
    # the picture is of that one record: against any other record of the site it is far off
    rebuilt = render(readout.planes)
    others = [psnr(rebuilt, render(planes_of(site["image"][i]))) for i in range(len(site["image"])) if i != index]
    assert max(others) < 30.0, max(others)


def test_a_larger_public_batch_gives_the_drawn_records_label_statistics_exactly(world, tmp_path, monkeypatch):
    """A public batch of several records is no protection of their labels: the mean of their gradients gives each
    joint's visible fraction over them and its distribution of positions over them, exactly."""
    import fedpose.shared.training.loop as loop
    from fedpose.shared.experiments.reconstruction_read import read_batch
    from fedpose.shared.model.simcc import gaussian_targets
    from fedpose.shared.configuration.schema import replace

    cfg = replace(attack_config(world), **{"train.public_batch_size": 4})
    policy = site_policy(cfg, tmp_path, release_blurred_images_and_labels=True, public_batch_size=4)
    crafted, basis = _crafted(cfg)
    drawn: list[int] = []
    real = loop.psi_on

    def watched(psi, batch, device):  # scoring only: which records the public term drew
        drawn.extend(int(i) for i in batch["index"])
        return real(psi, batch, device)

    monkeypatch.setattr(loop, "psi_on", watched)
    content = attack_content(cfg, crafted, basis, federation="fed-test", round=1, site="site-0",
                             sigma=min_sigma_for(policy), sample_rate=q_of(cfg))
    reply = handle_train(content, policy)
    grads = public_gradient_of(crafted.state, record_tensors(reply[ARRAYS]), crafted.read, lr=cfg.train.lr)
    readout = read_batch(crafted, grads, cfg.model)
    site = _site_psi(cfg, policy)
    assert len(set(drawn)) == 4
    vis = site["visible"][drawn].double()
    assert abs(readout.visible - vis.mean(0).numpy()).max() < 1e-6
    for axis in (0, 1):
        bins = readout.targets[axis].shape[1]
        t = gaussian_targets(site["joints"][drawn][..., axis].double(), bins, split_ratio=cfg.model.split_ratio,
                             sigma=cfg.model.sigma[axis])
        truth = ((vis[..., None] * t).sum(0) / vis.sum(0)[:, None].clamp(min=1)).numpy()
        rows = vis.sum(0).numpy() > 0
        assert abs(readout.targets[axis][rows] - truth[rows]).max() < 1e-5


def test_without_the_crafted_reply_there_is_nothing_to_read(world):
    """The read-out needs a trained reply: weights sent back unchanged give no gradient, and it says so."""
    cfg = attack_config(world)
    crafted, _ = _crafted(cfg)
    grads = public_gradient_of(crafted.state, crafted.state, crafted.read, lr=cfg.train.lr)
    with pytest.raises(ValueError, match="no gradient"):
        read_reply(crafted, grads, cfg.model, public_batch_size=1)
    with pytest.raises(ValueError, match="public_batch_size=4"):
        read_reply(crafted, grads, cfg.model, public_batch_size=4)


@pytest.mark.parametrize("method", ["fdp", "fpdp"])
@pytest.mark.invariant("P17")
def test_a_site_that_pins_record_level_methods_refuses_the_reconstruction_request(world, tmp_path, method):
    cfg = attack_config(world, method=method)
    policy = site_policy(cfg, tmp_path, methods=["dpsgd", "proj"])
    crafted, basis = _crafted(cfg)
    content = attack_content(cfg, crafted, basis if method == "fpdp" else None, federation="fed-test", round=1,
                             site="site-0", sigma=min_sigma_for(policy), sample_rate=q_of(cfg))
    with pytest.raises(Refusal) as refused:
        handle_train(content, policy)
    assert refused.value.code == RefusalCode.POLICY
    assert method in str(refused.value)
    assert spend_rows(policy) == []  # nothing trained, nothing spent
    assert site_info(policy).epsilon_spent == 0.0
