"""Secrets at rest: what a site keeps on disk is readable by its own account only, whatever the umask.

The site's ledger holds the noise seed of every charged round (knowing it, anyone can take the noise out
of the update the server received); beside it are the stored replies, the cached bases, the round lock, the
outcome of the site's checks (its record count), its held-out scores and its optimizer state. Each folder
the site makes is 0700 and each of these files 0600, whether or not a systemd unit sets a umask for it.

Real files throughout: the tiny synthetic world, real SQLite ledgers (their -wal and -shm files included),
``fedpose.client.site.handle_train``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from fedpose.client.ledger import SiteLedger
from fedpose.client.policy import min_sigma_for
from fedpose.client.site import handle_train
from fedpose.shared.configuration.schema import replace
from fedpose.shared.flower.messages import BASIS, basis_record
from support.site import site_policy, train_request


@pytest.fixture
def umask_022():
    old = os.umask(0o022)  # the usual default: files 0644, folders 0755
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> str:
    return oct(stat.S_IMODE(os.lstat(path).st_mode))


def _modes(top: Path) -> dict[str, str]:
    """Every folder and file under ``top`` (``top`` included), by its path relative to ``top``'s parent."""
    found = {top.name: _mode(top)}
    for path in top.rglob("*"):
        found[str(path.relative_to(top.parent))] = _mode(path)
    return found


def _round(cfg, state, p: int, policy, *, round: int = 1):
    """One real round of projected DP-SGD on a received V, the optimizer state kept: it writes every kind of file."""
    orthonormal, _ = torch.linalg.qr(torch.randn(p, cfg.privacy.k, dtype=torch.float64))
    cfg = replace(cfg, **{"federation.site_optimizer": "keep"})
    content = train_request(cfg, state, sigma=min_sigma_for(policy), method="proj", basis_version=1, round=round)
    content[BASIS] = basis_record(orthonormal.float(), version=1, dtype="float32")
    return handle_train(content, policy)


def test_a_round_leaves_the_sites_folders_0700_and_its_files_0600(world_trainable, tmp_path, umask_022):
    cfg, state, _, p = world_trainable
    top = tmp_path / "var"
    site = top / "fedpose" / "site-0"  # not there yet: the site makes it (and var/, fedpose/)
    policy = site_policy(cfg, site, eval_path=str(Path(cfg.data.root) / "val"))  # the site's checks: the first file
    _round(cfg, state, p, policy)
    with SiteLedger(policy.ledger_path, site=policy.site) as ledger:  # an open ledger has its -wal and -shm
        ledger.rows()
        modes = _modes(top)
    expected = {"var/fedpose/site-0/" + name for name in (
        "ledger.sqlite", "ledger.sqlite-wal", "ledger.sqlite-shm", "ledger.lock", "ledger.check.json",
        "evaluation.jsonl", "replies/fed-test-r1.pt", "basis-cache/fed-test-v1.npy", "optimizer/fed-test.pt")}
    assert expected <= set(modes), sorted(modes)
    folders = {name for name in modes if (tmp_path / name).is_dir()}
    assert {"var", "var/fedpose", "var/fedpose/site-0", "var/fedpose/site-0/replies",
            "var/fedpose/site-0/basis-cache", "var/fedpose/site-0/optimizer"} <= folders
    wrong = {name: mode for name, mode in modes.items() if mode != ("0o700" if name in folders else "0o600")}
    assert wrong == {}, wrong


def test_an_older_sites_files_are_narrowed_to_its_own_account(world_trainable, tmp_path, umask_022):
    """Files an older fedpose left 0644 (and its own folders 0755) are 0600 (0700) once the site writes again.

    The ledger's -wal and -shm are narrowed too while another process (an older console, say) holds them open
    with rounds not yet written back. A folder the operator made for the ledger keeps its mode: the site
    changes only what is its own.
    """
    import sqlite3

    cfg, state, _, p = world_trainable
    site = tmp_path / "site"
    site.mkdir()
    os.chmod(site, 0o755)
    policy = site_policy(cfg, site)
    _round(cfg, state, p, policy)
    for path in site.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    older = sqlite3.connect(policy.ledger_path, isolation_level=None)  # makes its -wal and -shm 0644, as the db
    try:
        version = older.execute("PRAGMA user_version").fetchone()[0]
        older.execute(f"PRAGMA user_version = {version}")  # a write: the -wal holds a frame
        assert (site / "ledger.sqlite-wal").stat().st_size > 0
        assert _mode(site / "ledger.sqlite-wal") == _mode(site / "ledger.sqlite-shm") == "0o644"
        site_policy(cfg, site)  # the site's checks again (its operator's step)
        _round(cfg, state, p, policy, round=2)
        with SiteLedger(policy.ledger_path, site=policy.site) as ledger:
            assert [row["round"] for row in ledger.rows()] == [1, 2]
        modes = _modes(site)
    finally:
        older.close()
    assert modes.pop("site") == "0o755"  # the operator's folder, as they made it
    folders = {name for name in modes if (tmp_path / name).is_dir()}
    assert {"site/replies", "site/basis-cache", "site/optimizer"} <= folders
    assert {"site/ledger.sqlite", "site/ledger.sqlite-wal", "site/ledger.sqlite-shm", "site/ledger.lock",
            "site/replies/fed-test-r2.pt"} <= set(modes)
    wrong = {name: mode for name, mode in modes.items() if mode != ("0o700" if name in folders else "0o600")}
    assert wrong == {}, wrong


def test_the_servers_ledger_is_0600_too(tmp_path, umask_022):
    from fedpose.server.ledger import ServerLedger

    out = tmp_path / "run" / "fed"
    with ServerLedger(out / "ledger.sqlite"):
        modes = _modes(tmp_path / "run")
    assert modes == {"run": "0o700", "run/fed": "0o700", "run/fed/ledger.sqlite": "0o600",
                     "run/fed/ledger.sqlite-wal": "0o600", "run/fed/ledger.sqlite-shm": "0o600"}
