"""Seeded runs repeat: the same seed gives the same weights with 1 and with 2 CPU threads in the environment,
because the run fixes its own thread count (runtime.threads) and asks for deterministic kernels."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.federation import REPO, tiny_dict

SCRIPT = """
import hashlib, json, sys
import torch
from fedpose.shared.configuration.schema import config_from_dict
from fedpose.shared.training.runs import run_pretrain
cfg = config_from_dict(json.loads(sys.argv[1]))
metrics = run_pretrain(cfg, progress=False)
state = torch.load(cfg.pretrain.out + "/model.pt", weights_only=False)["state_dict"]
digest = hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()
print(json.dumps({"digest": digest, "pckh": metrics["pckh"]["mean"], "threads": metrics["provenance"]["threads"],
                  "env": torch.get_num_threads()}))
"""


def test_pretraining_gives_the_same_weights_with_one_or_two_threads_in_the_environment(tmp_path: Path) -> None:
    results = []
    for threads in ("1", "2"):
        data = tiny_dict(tmp_path / "w")  # the same ward for both (generated once, then reused)
        data["pretrain"] = {**data["pretrain"], "out": str(tmp_path / f"pre-{threads}"), "epochs": 2}
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
               "PYTHONPATH": str(REPO)}
        done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(data)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    one, two = results
    assert one["threads"] == two["threads"] == 2  # the run's own count, whatever the environment said
    assert one["digest"] == two["digest"] and one["pckh"] == two["pckh"]
    assert hashlib.sha256(one["digest"].encode()).hexdigest()  # a real digest, not an empty one


def test_pretraining_gives_the_same_weights_whatever_thread_count_the_run_uses(tmp_path: Path) -> None:
    """A study's cells run with one thread each, the command line with two: both must reuse one start (the cached
    weights' identity leaves the thread count out, so weights that depended on it would mix two starts)."""
    results = []
    for threads in (1, 2):
        data = tiny_dict(tmp_path / "w")
        data["pretrain"] = {**data["pretrain"], "out": str(tmp_path / f"pre-{threads}"), "epochs": 2}
        data["runtime"] = {"threads": threads}
        done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(data)], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    one, two = results
    assert one["digest"] == two["digest"] and one["pckh"] == two["pckh"]


def test_cached_pretrained_weights_are_found_wherever_the_data_and_weights_are_named(tmp_path: Path) -> None:
    """The same ward and weights reached through another path (relative or absolute, a link) are the same start:
    re-pretraining would overwrite the weights every other run of that folder uses."""
    from fedpose.shared.configuration.schema import config_from_dict
    from fedpose.shared.training.runs import ensure_data, ensure_pretrained, pretrained_problem

    data = tiny_dict(tmp_path / "w")
    data["pretrain"] = {**data["pretrain"], "epochs": 1}
    cfg = config_from_dict(data)
    ensure_data(cfg, progress=False)
    ensure_pretrained(cfg, progress=False)
    (tmp_path / "link").symlink_to(tmp_path / "w")
    elsewhere = json.loads(json.dumps(data).replace(str(tmp_path / "w"), str(tmp_path / "link")))
    assert pretrained_problem(config_from_dict(elsewhere)) is None
    relative = json.loads(json.dumps(data).replace(str(tmp_path) + "/", ""))
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert pretrained_problem(config_from_dict(relative)) is None
    finally:
        os.chdir(cwd)


def test_a_record_from_an_installed_copy_names_the_commit_it_was_built_from(tmp_path: Path, monkeypatch) -> None:
    """An installed copy (a wheel on a GPU machine) has no git beside it: its records named no commit. The commit
    it was built from, given as FEDPOSE_SOURCE_COMMIT, is recorded, its state marked unknown; a malformed one is
    refused rather than written into a record."""
    from fedpose.shared.training import provenance

    monkeypatch.setattr(provenance, "REPO", tmp_path)  # no repository here
    monkeypatch.delenv("FEDPOSE_SOURCE_COMMIT", raising=False)
    assert provenance.provenance()["commit"] is None
    sha = "3b0413d" + "0" * 33
    monkeypatch.setenv("FEDPOSE_SOURCE_COMMIT", sha)
    record = provenance.provenance()
    assert (record["commit"], record["dirty"], record["commit_source"]) == (sha, None, "FEDPOSE_SOURCE_COMMIT")
    monkeypatch.setenv("FEDPOSE_SOURCE_COMMIT", "main; rm -rf")
    with pytest.raises(ValueError, match="FEDPOSE_SOURCE_COMMIT"):
        provenance.provenance()
    monkeypatch.setattr(provenance, "REPO", REPO)  # in the checkout, git's own commit wins
    assert provenance.provenance()["commit"] != sha
