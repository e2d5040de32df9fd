"""What the site pins and records for its guarantee (P3, P11, P12; issue findings 8.3, 8.7, 15.5, 15.6).

Real files throughout: the tiny synthetic world, real SQLite ledgers, the real local-training loop.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedpose.client.ledger import Mechanism, SiteLedger
from support.federation import prepare_world, world_root
from fedpose.shared.privacy.accounting.history import LedgerBusy


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return prepare_world(world_root(tmp_path_factory))


@pytest.mark.invariant("P3")
def test_psi_sees_the_canonical_crop_through_the_real_training_loop(cfg, monkeypatch):
    """P3 end to end (finding 8.3): with augmentation on, the public gradient's input is psi(canonical crop).

    The augmented crop of a record (rescaled, rotated, flipped) shows pixels outside the record's
    canonical crop and a sharper effective blur; psi must be applied to the canonical crop.
    """
    import fedpose.shared.training.loop as step_module
    import fedpose.shared.training.batches as batches
    import fedpose.shared.training.loop as train_module
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.data.dataset import PoseDataset
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.data.augment import Augment
    from fedpose.shared.privacy.step.noise import make_generator
    from fedpose.shared.training.runs import initial_model

    cfg = replace(cfg, **{"train.method": "fdp", "data.augment": True})
    records = load_split(Path(cfg.data.root), "site-0")
    dataset = PoseDataset(records, input_size=cfg.data.input_size, augment=Augment(), seed=0)
    canonical = PoseDataset(records, input_size=cfg.data.input_size, augment=None)
    psi = batches.make_psi_from(cfg.privacy, torch.Generator().manual_seed(0))
    seen = []
    real = step_module.dp_gradient

    def spy(loss_fn, params, *, psi_batch, **kwargs):
        seen.append(psi_batch)
        return real(loss_fn, params, psi_batch=psi_batch, **kwargs)

    monkeypatch.setattr(step_module, "dp_gradient", spy)
    generator, _ = make_generator(0, "cpu")
    model = initial_model(cfg, progress=False)
    local_data = train_module.LocalData(dataset)
    local_run = train_module.LocalRun(train_module.step_spec("fdp", cfg.train, cfg.privacy, sigma=1.0,
                                      data=local_data), 3, cfg.train, cfg.privacy)
    train_module.local_train(model, local_data, local_run, generator=generator, bar=None)
    assert len(seen) == 3
    everyone = canonical.batch(list(range(len(records))))
    psi_all = psi(everyone["image"])  # psi(x) of every record's canonical crop
    for psi_batch in seen:
        images, joints = psi_batch.tensors["image"], psi_batch.tensors["joints"]
        assert images.shape[0] == cfg.train.public_batch_size
        for image, joint in zip(images, joints):
            # bit-identical to psi of one record's canonical crop, with that record's labels
            match = [i for i in range(len(records)) if torch.equal(image, psi_all[i])]
            assert len(match) == 1
            assert torch.equal(joint, everyone["joints"][match[0]])


def _mechanism(method: str = "fpdp") -> Mechanism:
    return Mechanism(method=method, psi="blur(0.06)" if method in ("fdp", "fpdp") else None, clip_norm=1.0,
                     augment=True)


def _record(ledger: SiteLedger, round: int, method: str = "fpdp", federation: str = "f") -> float:
    with ledger.round() as open_round:
        return open_round.record(site="site-0", federation=federation, round=round, sigma=2.0, sample_rate=0.2,
                                 steps=2, delta=1e-3, budget=10.0, accountant="rdp", mechanism=_mechanism(method))


@pytest.mark.invariant("P12")
def test_ledger_rows_record_the_mechanism_and_the_claim_is_record_level_only_when_every_row_was(tmp_path):
    """Finding 8.7 / P12: a Feature-DP round makes the whole ledger's claim Feature-DP."""
    with SiteLedger(tmp_path / "l.sqlite", site="site-0") as ledger:
        _record(ledger, 1, "dpsgd")
        _record(ledger, 2, "proj")
        assert ledger.record_level()
        _record(ledger, 3, "fpdp")
        assert not ledger.record_level()
        rows = ledger.rows()
        assert [(r["method"], r["psi"]) for r in rows] == [("dpsgd", None), ("proj", None), ("fpdp", "blur(0.06)")]
        with pytest.raises(ValueError, match="already in the ledger"):
            _record(ledger, 3)  # one (federation, round), once
        assert len(ledger.rows()) == 3
        assert ledger.epsilon(delta=1e-3, accountant="rdp", federation="other") == 0.0


def test_a_ledger_of_another_site_a_corrupt_file_and_a_schema_1_ledger(tmp_path):
    """Finding 15.6: the ledger names its site; a mismatch, garbage or an old schema are handled clearly."""
    path = tmp_path / "l.sqlite"
    with SiteLedger(path, site="site-0") as ledger:
        _record(ledger, 1)
    with pytest.raises(ValueError, match="belongs to site site-0"):
        SiteLedger(path, site="site-1")
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(ValueError, match="not an SQLite database"):
        SiteLedger(junk, site="site-0")
    other = tmp_path / "other.sqlite"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE notes (x)")
    conn.commit()
    conn.close()
    with pytest.raises(ValueError, match="not a fedpose site ledger"):
        SiteLedger(other, site="site-0")
    # A schema-1 ledger (no method column) is migrated; its rows read 'unknown': no record-level claim.
    old = tmp_path / "v1.sqlite"
    conn = sqlite3.connect(old)
    conn.execute("""CREATE TABLE spend (id INTEGER PRIMARY KEY AUTOINCREMENT, site TEXT NOT NULL,
        federation TEXT NOT NULL, round INTEGER NOT NULL, sigma REAL NOT NULL, sample_rate REAL NOT NULL,
        steps INTEGER NOT NULL, delta REAL NOT NULL, epsilon REAL NOT NULL, budget REAL NOT NULL,
        accountant TEXT NOT NULL, recorded_at TEXT NOT NULL)""")
    conn.execute("INSERT INTO spend (site, federation, round, sigma, sample_rate, steps, delta, epsilon, budget,"
                 " accountant, recorded_at) VALUES ('site-0', 'f', 1, 2.0, 0.2, 2, 1e-3, 0.1, 1.0, 'rdp', 'now')")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    with SiteLedger(old, site="site-0") as ledger:
        assert ledger.rows()[0]["method"] == "unknown" and not ledger.record_level()
        _record(ledger, 2, "dpsgd")
        assert len(ledger.history()) == 2
    with pytest.raises(ValueError, match="belongs to site site-0"):
        SiteLedger(old, site="hospital-b")


def test_a_locked_ledger_is_waited_for_with_a_message_and_a_bound(tmp_path, caplog):
    """Finding 15.6: a round in progress elsewhere holds the lock; the wait is announced and bounded."""
    path = tmp_path / "l.sqlite"
    SiteLedger(path, site="site-0").close()
    holder = sqlite3.connect(path, timeout=0, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with SiteLedger(path, site="site-0", busy_timeout=1.0) as ledger:
            t0 = time.monotonic()
            with caplog.at_level("WARNING"), pytest.raises(LedgerBusy, match="locked by another process"):
                with ledger.round():
                    pass
            assert time.monotonic() - t0 < 30
            assert any("waiting" in r.getMessage() for r in caplog.records)
        # Released in time, the same wait succeeds.
        threading.Timer(0.5, lambda: holder.execute("ROLLBACK")).start()
        with SiteLedger(path, site="site-0", busy_timeout=20.0) as ledger:
            _record(ledger, 1)
            assert len(ledger.rows()) == 1
    finally:
        holder.close()


@pytest.mark.invariant("P8")
def test_claims_name_what_is_released_and_the_replace_one_epsilon(tmp_path):
    """Finding 8.4: releasing q = B/n (hence n) changes the adjacency; the claim says so, with its epsilon."""
    from fedpose.shared.privacy.accounting.accountant import StepRecord, epsilon_spent
    from fedpose.shared.privacy.accounting.claims import privacy_claim

    sigma, q, steps = 6.441, 0.053, 570
    add_remove = epsilon_spent([StepRecord(sigma=sigma, sample_rate=q, steps=steps)], delta=1e-5)
    replace_one = epsilon_spent([StepRecord(sigma=sigma / 2, sample_rate=q, steps=steps)], delta=1e-5)
    # The issue measured ~1.48 with a tighter replace-one analysis; sensitivity 2C (sigma / 2) is conservative: ~1.76.
    assert add_remove == pytest.approx(0.8, abs=0.01) and 1.4 < replace_one < 1.9
    claim = privacy_claim(method="dpsgd", epsilon=add_remove, delta=1e-5, psi=None, seeded=False, accountant="rdp",
                          released=f"n is public: replace-one eps={replace_one:.4g}")
    assert "add/remove" in claim and f"{replace_one:.4g}" in claim


def test_a_centralized_run_releases_no_n_and_states_the_replace_one_guarantee(cfg, tmp_path):
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.training.runs import run_train

    small = replace(cfg, **{"train.method": "dpsgd", "train.epochs": 1})
    metrics = run_train(small, tmp_path / "run", progress=False)
    assert "n" not in metrics and "mean_batch" not in metrics
    assert metrics["epsilon_replace_one"] > metrics["epsilon"]
    assert "replace-one" in metrics["claim"] and f"{metrics['epsilon_replace_one']:.4g}" in metrics["claim"]
    assert np.isfinite(metrics["epsilon"])
