"""P17: Feature-DP is an explicit opt-in, said in plain words wherever a guarantee is shown.

Under fdp and fpdp each local step adds the noise-free, unclipped gradient of the public loss on psi(x) of records
drawn from the site's data; outside the basis V it reaches the server exactly, and with crafted weights a server
rebuilds the blurred image and the pose labels of each record drawn (docs/results/privacy-attacks.md). That is
within Feature-DP's definition, so:

- a site's policy allows only the record-level methods unless one line opts in, and a policy that lists fdp/fpdp
  without that line is refused, naming it; the kit's template is record-level;
- the public draw is pinned: its size is the policy's (a request for another is refused), its records are distinct
  and never more than the site holds (the site's own check refuses such a policy);
- the console, ``fedpose site status`` and the printed claim say which guarantee is in force and, under Feature-DP,
  that the server can read the blurred images and labels exactly.

Real files: the tiny synthetic world, real SQLite ledgers, ``fedpose.client.site.handle_train``.
"""

from __future__ import annotations

import pytest
import torch

from fedpose.client.policy import min_sigma_for
from fedpose.client.site import handle_train
from fedpose.shared.configuration.schema import replace
from fedpose.shared.flower.messages import Refusal, RefusalCode
from support.site import site_policy, train_request, spend_rows

# What a Feature-DP site without a fixed public set gives a server over a whole federation, in plain words.
DRAWS_SHOW = ("over a federation the server sees the blurred copy and labels of every record the public term draws, "
              "and from the draws it can count them")


@pytest.mark.invariant("P17")
def test_a_policy_that_lists_feature_dp_without_the_opt_in_line_is_refused(world_weights, tmp_path):
    cfg, _ = world_weights
    with pytest.raises(ValueError, match="release_blurred_images_and_labels: true") as refused:
        site_policy(cfg, tmp_path, methods=["dpsgd", "fpdp"], release_blurred_images_and_labels=False, prepare=False)
    assert "blurred copy of each image" in str(refused.value) and "pose labels" in str(refused.value)
    assert DRAWS_SHOW in str(refused.value)
    opted = site_policy(cfg, tmp_path, release_blurred_images_and_labels=True, prepare=False)
    assert opted.methods == ("dpsgd", "proj", "fdp", "fpdp")  # the one line opts in to all four


@pytest.mark.invariant("P17")
def test_a_policy_without_methods_trains_the_record_level_methods_only(world_weights, tmp_path):
    cfg, state = world_weights
    policy = site_policy(cfg, tmp_path, release_blurred_images_and_labels=False)
    assert policy.methods == ("dpsgd", "proj")
    sigma = min_sigma_for(policy)
    for method in ("fdp", "fpdp"):
        with pytest.raises(Refusal) as refused:
            handle_train(train_request(cfg, state, sigma=sigma, method=method), policy)
        assert refused.value.code == RefusalCode.POLICY
    assert spend_rows(policy) == []
    handle_train(train_request(cfg, state, sigma=sigma, method="dpsgd"), policy)
    assert [r["method"] for r in spend_rows(policy)] == ["dpsgd"]


@pytest.mark.invariant("P17")
def test_the_kit_policy_is_record_level_and_names_what_the_opt_in_releases():
    from fedpose.server.kits import templates as kit

    text = kit.POLICY
    assert "release_blurred_images_and_labels: false" in text
    opt_in = next(line for line in text.splitlines() if line.startswith("release_blurred_images_and_labels"))
    assert "blurred" in opt_in and "labels" in opt_in  # the line itself says what it releases
    assert "methods:" not in text.replace("# methods", "")  # no method list that could opt in silently


@pytest.mark.invariant("P17")
def test_the_public_batch_is_pinned_by_the_site(world_weights, tmp_path):
    cfg, state = world_weights
    policy = site_policy(cfg, tmp_path, release_blurred_images_and_labels=True,
                     public_batch_size=cfg.train.public_batch_size)
    sigma = min_sigma_for(policy)
    larger = replace(cfg, **{"train.public_batch_size": cfg.train.public_batch_size + 1})
    with pytest.raises(Refusal) as refused:
        handle_train(train_request(larger, state, sigma=sigma, method="fdp"), policy)
    assert refused.value.code == RefusalCode.POLICY and "public_batch_size" in refused.value.reason
    assert spend_rows(policy) == []
    with pytest.raises(ValueError, match="public_batch_size=41 is larger than the 40 records"):
        site_policy(cfg, tmp_path / "big", release_blurred_images_and_labels=True, public_batch_size=41)


@pytest.mark.invariant("P17")
def test_the_public_draw_never_repeats_a_record_and_never_exceeds_the_data(world_weights, monkeypatch):
    from pathlib import Path

    import fedpose.shared.training.loop as step_module
    from fedpose.shared.training import batches
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.training.runs import initial_model
    from fedpose.shared.training.batches import make_dataset
    from fedpose.shared.training.loop import LocalData, LocalRun, local_train, step_spec

    cfg, _ = world_weights
    records = load_split(Path(cfg.data.root), "site-0")[:6]
    drawn: list[list[int]] = []
    real = batches.psi_on

    def spy(psi, batch, device):  # under fdp only the public draw maps a batch by psi
        drawn.append(sorted(int(i) for i in batch["index"]))
        return real(psi, batch, device)

    monkeypatch.setattr(step_module, "psi_on", spy)
    fdp = replace(cfg, **{"train.method": "fdp", "train.public_batch_size": 6})
    model = initial_model(fdp, progress=False)
    local_data = LocalData(make_dataset(records, fdp, train=True, seed=0))
    local_run = LocalRun(step_spec("fdp", fdp.train, fdp.privacy, sigma=1.0, data=local_data, sample_rate=0.5,
                         expected_batch=3.0), 3, fdp.train, fdp.privacy)
    local_train(model, local_data, local_run, generator=torch.Generator().manual_seed(0), bar="train")
    assert drawn and all(len(set(d)) == len(d) == 6 for d in drawn)
    seven = replace(fdp, **{"train.public_batch_size": 7})
    with pytest.raises(ValueError, match="public_batch_size=7 is larger than the 6 records"):
        local_data = LocalData(make_dataset(records, seven, train=True, seed=0))
        local_run = LocalRun(step_spec("fdp", seven.train, seven.privacy, sigma=1.0, data=local_data,
                             sample_rate=0.5, expected_batch=3.0), 1, seven.train, seven.privacy)
        local_train(model, local_data, local_run, generator=torch.Generator().manual_seed(0), bar="train")


@pytest.mark.invariant("P17")
def test_the_console_status_and_claim_say_which_guarantee_is_in_force(world_weights, tmp_path):
    from fedpose.client.status import guarantee_in_force, plain_policy
    from fedpose.shared.privacy.accounting.claims import privacy_claim

    cfg, _ = world_weights
    record = site_policy(cfg, tmp_path / "r", release_blurred_images_and_labels=False, prepare=False)
    feature = site_policy(cfg, tmp_path / "f", release_blurred_images_and_labels=True, prepare=False)
    assert guarantee_in_force(record).startswith("record-level DP")
    assert guarantee_in_force(feature).startswith("Feature-DP opted in")
    said = " ".join(plain_policy(feature))
    assert "never images, labels" not in said
    assert DRAWS_SHOW in said and DRAWS_SHOW in guarantee_in_force(feature)
    pooled = site_policy(cfg, tmp_path / "p", release_blurred_images_and_labels=True, public_records=8, prepare=False)
    pooled_said = " ".join(plain_policy(pooled)) + guarantee_in_force(pooled)
    assert DRAWS_SHOW not in pooled_said and "at most the 8 records of a fixed set" in pooled_said
    assert "not how many this site holds" in pooled_said
    assert "can read, exactly, a blurred copy of each image" in said and "pose labels" in said
    assert "never images, labels or records" in " ".join(plain_policy(record))
    claim = privacy_claim(method="fpdp", epsilon=0.8, delta=1e-5, psi="blur(0.03)", seeded=False, accountant="rdp")
    assert "the server can read, exactly, psi(x) of each image drawn for the public term and its pose labels" in claim
    assert "read, exactly" not in privacy_claim(method="dpsgd", epsilon=0.8, delta=1e-5, psi=None, seeded=False,
                                                accountant="rdp")


@pytest.mark.invariant("P17")
def test_a_pinned_public_set_bounds_the_records_the_draws_ever_show(world_weights, tmp_path, monkeypatch):
    """With ``public_records: m`` the public term draws from a fixed set of m records the site's check chose (the
    same set on every check of the same data), so over any number of rounds the draws show at most those m records
    and never how many the site holds."""
    import fedpose.shared.training.loop as step_module
    from fedpose.client.data import prepare_site, read_site_check
    from fedpose.shared.training import batches

    cfg, state = world_weights
    with pytest.raises(ValueError, match="public_records=3 is smaller than public_batch_size=4"):
        site_policy(cfg, tmp_path / "small", public_records=3, public_batch_size=4, prepare=False)
    with pytest.raises(ValueError, match="public_records=41 is more than the 40 records"):
        site_policy(cfg, tmp_path / "big", public_records=41)
    policy = site_policy(cfg, tmp_path, public_records=6, public_batch_size=4, max_rounds=3)
    chosen = read_site_check(policy).extra["public_pool"]
    assert len(chosen) == 6 and len(set(chosen)) == 6
    assert read_site_check(policy).extra["public_pool"] == prepare_site(policy).extra["public_pool"] == chosen
    drawn: set[int] = set()
    real = batches.psi_on

    def spy(psi, batch, device):  # under fdp only the public draw maps a batch by psi
        drawn.update(int(i) for i in batch["index"])
        return real(psi, batch, device)

    monkeypatch.setattr(step_module, "psi_on", spy)
    for rnd in (1, 2, 3):
        handle_train(train_request(cfg, state, sigma=min_sigma_for(policy), method="fdp", steps=2, round=rnd), policy)
    assert drawn and drawn <= set(chosen)  # 24 draws of 4, from 6 records only
