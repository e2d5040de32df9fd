"""Which policy a site runs under: deployment reads the file its node config names; simulation
derives one per partition from the config (written once, then read back).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedpose.client.policy import SitePolicy, load_policy, policy_from_dict, write_policy
from fedpose.shared.privacy.step.psi import psi_strength
from fedpose.shared.configuration.methods import WITH_PUBLIC
from fedpose.client.data import load_split_dir
from fedpose.shared.configuration.schema import Config
from fedpose.shared.data.patients import group_by_patient, stated_group_size
from fedpose.shared.data.split import manifest_digest as public_digest

log = logging.getLogger(__name__)


def resolve_policy(node_config: Mapping[str, Any], run_config: Mapping[str, Any]) -> SitePolicy:
    """The site's policy.

    Deployment: ``--node-config "site-policy='/etc/fedpose/policy.yaml'"``: the
    policy names the data, the ledger and the public set; nothing the server
    sends can change them. Simulation: the virtual node with ``partition-id``
    i is site ``data.train_splits[i]``; its policy is
    ``<out>/sites/<split>/policy.yaml`` (written by ``fedpose simulate``, or
    created here from the config when absent).
    """
    if "site-policy" in node_config:
        if "data-path" in node_config:
            raise ValueError("node config: data-path is no longer read; the site policy's data_path names the data")
        return load_policy(str(node_config["site-policy"]))
    if "partition-id" in node_config:
        from fedpose.shared.flower.run_config import config_from_run_config, out_dir

        cfg = config_from_run_config(run_config)
        return simulation_policy(cfg, out_dir(run_config, cfg), int(node_config["partition-id"]))
    raise ValueError(
        "this SuperNode has no site policy: start it with --node-config \"site-policy='/path/policy.yaml'\""
    )


def default_policy(cfg: Config, out: Path, index: int) -> SitePolicy:
    """Simulation default for site ``index``: the config's mechanism and budget pinned, its split, a ledger
    under ``out``.

    The operator of a site knows its n, so it states q = B / n and the
    normaliser B (``expected_batch``) in its policy: both public constants,
    which reveal n only as the operator's own choice of q does. At patient
    level (``privacy.unit``) n counts patients and q is the patient rate q_p. At record level the
    policy states the most records a patient has in the split (from its
    patient ids) as its cap, unless the config gives one: the claim's group
    bound is stated at it.
    """
    splits = cfg.data.train_splits
    if not 0 <= index < len(splits):
        raise ValueError(f"partition-id {index} has no split: data.train_splits has {len(splits)} ({list(splits)})")
    root = Path(cfg.data.root).expanduser().resolve()
    name = splits[index]
    private = load_split_dir(root / name, "site data")
    cap = cfg.privacy.max_records_per_patient
    if cfg.privacy.unit == "patient":
        n = group_by_patient(private, cap=cap)[1].count
    else:
        n = len(private)
        if cap is None:
            cap, _ = stated_group_size(private, None)
    public = load_split_dir(root / cfg.data.public_split, "public set")
    return policy_from_dict({
        "policy_version": 3,
        "site": name,
        "epsilon": cfg.privacy.epsilon,
        "delta": cfg.privacy.delta,
        "lifetime_rounds": cfg.federation.rounds,
        "rounds_per_federation": cfg.federation.rounds,
        "sample_rate": min(1.0, cfg.train.batch_size / n),
        "expected_batch": float(cfg.train.batch_size),
        "steps_per_round": cfg.federation.local_steps,
        "clip_norm": cfg.privacy.clip_norm,
        "psi": cfg.privacy.psi,
        "psi_min": psi_strength(cfg.privacy.psi, cfg.privacy.psi_param, cfg.data.input_size),
        "augment": cfg.data.augment,
        "augment_multiplicity": cfg.privacy.augment_multiplicity,
        "data_path": str(root / name),
        "ledger_path": str(out / "sites" / name / "ledger.sqlite"),
        "public_path": str(root / cfg.data.public_split),
        "public_digest": public_digest(public),
        "accountant": cfg.privacy.accountant,
        # The researcher's own simulation opts its sites in to what its method releases (the claim says so).
        "release_blurred_images_and_labels": cfg.train.method in WITH_PUBLIC,
        "public_batch_size": cfg.train.public_batch_size,
        "unit": cfg.privacy.unit,
        "max_records_per_patient": cap,
        # A seeded run (train.seed) seeds every site's noise from it: reproducible, and marked not for production.
        "seed": None if cfg.train.seed is None else cfg.train.seed * 1000 + index,
        # Chunks sized from the free memory as the config asks, at most its chunk_size (else 16 rows, as before)
        **({"chunk_memory": cfg.privacy.chunk_memory, "chunk_size": cfg.privacy.chunk_size}
           if cfg.privacy.chunk_memory is not None else {}),
    })


def simulation_policy(cfg: Config, out: Path, index: int) -> SitePolicy:
    splits = cfg.data.train_splits
    if not 0 <= index < len(splits):
        raise ValueError(f"partition-id {index} has no split: data.train_splits has {len(splits)} ({list(splits)})")
    path = out / "sites" / splits[index] / "policy.yaml"
    if path.is_file():
        return load_policy(path)
    from fedpose.client.data import prepare_site

    policy = default_policy(cfg, out, index)
    write_policy(path, policy)
    prepare_site(policy)  # the simulated site's operator step: its checks, once
    log.info("site %s: wrote default simulation policy %s", policy.site, path)
    return policy


def _units(policy_data: dict, base: Path) -> int:
    """The site's privacy units (records, or patients at patient level) in its data: read locally, once."""
    data = Path(policy_data["data_path"])
    records = load_split_dir(data if data.is_absolute() else base / data, "site data")
    if policy_data.get("unit") == "patient":
        return group_by_patient(records, cap=policy_data.get("max_records_per_patient"))[1].count
    return len(records)


def write_site_policy(out: str | Path, values: dict[str, Any]) -> SitePolicy:
    """``fedpose site-policy``: write the policy file ``out`` from the operator's own ``values`` (every field but
    the version and the public digest). The public set it names (relative to ``out``'s folder) is approved as it
    is now, its digest written; a ``sample_rate`` of None is derived here, once, as q = B / n from the data (n
    itself is never written)."""
    out = Path(out).resolve()
    digest = None
    if values.get("public_path"):
        public = Path(values["public_path"])
        public = public if public.is_absolute() else (out.parent / public)
        digest = public_digest(load_split_dir(public.resolve(), "public set"))
    data = {"policy_version": 3, **values, "public_digest": digest}
    if data["sample_rate"] is None:  # q = B / n from the data, here, once: n itself is never written
        data["sample_rate"] = round(min(1.0, data["expected_batch"] / _units(data, out.parent)), 4)
    policy = policy_from_dict(data, base=out.parent)
    write_policy(out, policy)
    return policy
