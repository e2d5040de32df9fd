"""A site over the tiny world's site-0 for in-process tests of ``fedpose.client.site.handle_train``: its policy,
train requests as the server sends them, its ledger's rows, and the ways a round is cut short.

Real parts throughout: the tiny synthetic world on disk, real SQLite ledgers, the site's own checks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fedpose.client.ledger import SiteLedger
from fedpose.client.policy import policy_from_dict
from fedpose.client.site import handle_train
from fedpose.shared.configuration.schema import replace
from fedpose.shared.flower.messages import ARRAYS, CONFIG, Refusal, TrainRequest, weights_record


def public_digest_of(cfg) -> str:
    from fedpose.client.data import load_split_dir
    from fedpose.shared.data.split import manifest_digest as public_digest

    return public_digest(load_split_dir(Path(cfg.data.root) / "public", "public set"))


def site_policy(cfg, tmp_path: Path, *, max_rounds: int = 2, prepare: bool = True, **overrides):
    """A site policy over the tiny world's site-0; ``prepare``: run the site's own checks (its operator's step)."""
    from fedpose.client.data import prepare_site

    data = {
        "policy_version": 3, "site": "site-0", "epsilon": 2.0, "delta": 1e-3, "lifetime_rounds": max_rounds,
        "rounds_per_federation": max_rounds, "sample_rate": q_of(cfg), "expected_batch": float(cfg.train.batch_size),
        "steps_per_round": 2,
        "clip_norm": cfg.privacy.clip_norm, "psi": cfg.privacy.psi, "psi_min": cfg.privacy.psi_param,
        "augment": cfg.data.augment,
        "data_path": str(Path(cfg.data.root) / "site-0"), "ledger_path": str(tmp_path / "ledger.sqlite"),
        "public_path": str(Path(cfg.data.root) / "public"), "public_digest": public_digest_of(cfg),
        "release_blurred_images_and_labels": True, "public_batch_size": cfg.train.public_batch_size,
    }
    data.update(overrides)
    policy = policy_from_dict(data)
    if prepare:
        prepare_site(policy)
    return policy


def train_request(cfg, state, *, sigma: float, steps: int = 1, round: int = 1, method: str = "dpsgd",
             basis_version: int = 0, basis_mode: str = "broadcast", site: str = "site-0", federation: str = "fed-test",
             sample_rate: float | None = None):
    from flwr.app import RecordDict

    cfg = replace(cfg, **{"train.method": method})
    request = TrainRequest(federation=federation, round=round, site=site, sigma=sigma,
                           sample_rate=q_of(cfg) if sample_rate is None else sample_rate, steps=steps,
                           basis_version=basis_version, basis_mode=basis_mode, config=cfg)
    return RecordDict({ARRAYS: weights_record(state), CONFIG: request.to_record()})


def spend_rows(policy) -> list[dict]:
    with SiteLedger(policy.ledger_path) as ledger:
        return ledger.rows()


def q_of(cfg, n: int = 40) -> float:
    return min(1.0, cfg.train.batch_size / n)


def refusal_of(content, policy) -> Refusal:
    with pytest.raises(Refusal) as info:
        handle_train(content, policy)
    return info.value


def count_training(monkeypatch) -> list[int]:
    """Count the rounds that reach local training (each one reads private data on the round's noise)."""
    import fedpose.shared.training.loop as train_module

    real = train_module.local_train
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "local_train", counted)
    return calls


def crash_mid_round(content, policy) -> None:
    """Run ``handle_train(content, policy)`` in a child process that is killed (SIGKILL, as a power cut or the
    kernel's out-of-memory killer would) once local training has read its first private batch: no handler of
    the site runs, the round's row stays as the crash left it."""
    import os
    import signal

    pid = os.fork()
    if pid == 0:  # the site process that dies
        try:
            import fedpose.shared.training.loop as train_module

            def killed(model, data, run, **kwargs):
                data.private.batch([0])
                os.kill(os.getpid(), signal.SIGKILL)

            train_module.local_train = killed
            handle_train(content, policy)
        finally:
            os._exit(70)  # only reached when the round never got to training (a refusal, say)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, \
        f"the site process was not killed mid-round (wait status {status})"


def cut_split(split: Path, keep: int) -> None:
    """Keep only the first ``keep`` records of a split (annotations and their sidecars cut alike)."""
    for name in ("annotations.json", "headboxes.json", "identities.json"):
        path = split / name
        if path.is_file():
            path.write_text(json.dumps(json.loads(path.read_text())[:keep]))


def subset_split(cfg, out: Path, keep: int) -> Path:
    """A copy of site-0 holding only its first ``keep`` records."""
    shutil.copytree(Path(cfg.data.root) / "site-0", out)
    cut_split(out, keep)
    return out

