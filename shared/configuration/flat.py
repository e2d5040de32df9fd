"""Dotted-key (flat) views of nested config data: Flower's run config holds flat scalars only."""

from __future__ import annotations

import dataclasses
from typing import Any

from fedpose.shared.errors import ConfigError


def flatten_plain(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.update(flatten_plain(value, path))
        else:
            out[path] = value
    return out


def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dict (tuples as lists) of a config dataclass."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value)
        elif isinstance(value, tuple):
            out[f.name] = list(value)
        else:
            out[f.name] = value
    return out


def flatten(cfg: Any) -> dict[str, Any]:
    """Dotted-key view; lists stay lists (callers needing scalars join them)."""
    return flatten_plain(to_dict(cfg))


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.split(".")
        node = out
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"config key {key}: {part} is a value, not a section")
            node = nxt
        node[parts[-1]] = value
    return out


# Config fields added after artefacts were cached, each with the value that means "as before". Identity views
# (the fingerprint of cached pretrained weights, a study cell's id, a synthetic ward's manifest) leave such a
# field out at that value, so an artefact made before the field existed stays valid and a study cell keeps its id.
LATER_FIELDS: dict[str, Any] = {"data.synth.public_style": "public", "privacy.psi_eps": 1.0, "privacy.psi_m": 1,
                                 "federation.update_bound": "none", "data.source": None,
                                 "pretrain.photometric": 0.0, "pretrain.init": None, "data.help": "",
                                 "privacy.noise_factor": 1.0, "model.face_tasks": [], "model.face_attributes": 4,
                                 "pretrain.threads": 2, "privacy.augment_multiplicity": 1, "train.ema": 0.0,
                                 "privacy.basis_clip": None, "train.tensor_scales": "none",
                                 "train.lora_rank": 8, "privacy.noise_multiplier": None,
                                 "train.task_weights": "train", "privacy.basis_rows": "raw",
                                 "data.synth.basis": 0, "data.basis_split": None, "train.adam_floor": 0.0,
                                 "privacy.chunk_memory": None}
# Sections that say how a run uses the machine, not what it computes: never part of an identity view.
RUNTIME_SECTIONS = ("runtime.",)


def without_as_before(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flat ``values`` (keys under ``prefix``) without the later-added fields that hold their as-before value."""
    return {k: v for k, v in values.items()
            if not (prefix + k in LATER_FIELDS and LATER_FIELDS[prefix + k] == v)}


def identity_flat(cfg: Any) -> dict[str, Any]:
    """``flatten(cfg)`` without the runtime section and the later-added fields that hold their as-before value."""
    return without_as_before({k: v for k, v in flatten(cfg).items() if not k.startswith(RUNTIME_SECTIONS)})


def config_fingerprint(cfg: Any, *sections: str) -> dict[str, Any]:
    """The config sections that determine a cached artefact (compared on reuse)."""
    d = unflatten(identity_flat(cfg))
    return {s: d[s] for s in sections}
