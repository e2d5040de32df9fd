"""What server and sites say to each other, in Flower records (docs/explanation/design.md: one federated round).

Client and server never import each other, so the wire format lives here:
record keys, refusal codes, the train request, the site's self-description
and (de)serialisation of weights and of the projection basis V.

Messages (Flower Message API, one RecordDict each):

- query (server -> site, before the first round): an empty ``config``
  (unknown fields are refused: a query carries nothing the site would compare
  with its private data); reply ``info`` = ``SiteInfo``: what the site's own
  policy declares public (name, budget, rounds, sample rate, steps, clip, psi
  and its minimum strength, the minimum sigma) and its spend so far. Never n.
- train (server -> site): ``arrays`` = the full global state_dict (float32),
  ``config`` = ``TrainRequest``, and ``basis`` = V (p x k, float16 by
  default) plus its version, only when the site does not hold that version.
  Reply: ``arrays`` = the trainable parameters after local training (the
  frozen ones cannot change, so they are not sent back), ``metrics`` = what
  actually ran (sigma, q, steps) and the site's own epsilon (lifetime and
  this federation's), nothing else (P10: no n, no timings).
- a refusal is an ``Error`` reply with one of the ``RefusalCode`` values
  (nothing was trained, nothing was spent); its reason ends with the site's
  spend (``spend_suffix``), so a server learns of rounds it never saw a
  reply for (a crash between the site's commit and the reply).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np
import torch

from fedpose.shared.configuration.schema import Config, config_from_dict
from fedpose.shared.configuration.flat import to_dict

log = logging.getLogger(__name__)

# RecordDict keys
ARRAYS = "arrays"
CONFIG = "config"
BASIS = "basis"
METRICS = "metrics"
INFO = "info"

# Keys inside the basis ArrayRecord
BASIS_MATRIX = "V"
BASIS_VERSION = "version"
# Keys inside the weights ArrayRecord: every tensor in one float32 vector, and the names and shapes (JSON)
WEIGHTS_VALUES = "values"
WEIGHTS_LAYOUT = "layout"

BASIS_MODES = ("broadcast", "site")
BASIS_DTYPES = ("float16", "float32")


class RefusalCode(IntEnum):
    """Error codes of a site's refusal (Flower's own codes are < 1000)."""

    WEAKER_NOISE = 1001  # sigma below the site's own minimum (P6)
    BUDGET = 1002  # the round would exceed the site's epsilon or its max rounds (P6)
    BAD_BASIS = 1003  # V has the wrong shape or is not orthonormal
    BAD_REQUEST = 1004  # malformed request, weights that do not fit, unknown site
    NEED_BASIS = 1005  # the site does not hold the requested basis version: send V
    POLICY = 1006  # the request asks for something the site's policy does not allow (method, psi, q, ...)
    ALREADY_SPENT = 1008  # this (federation, round) was already trained and spent: never twice (P11)
    MISCONFIGURED = 1009  # the site's own start-up checks failed (its operator must fix its policy)
    SITE_ERROR = 1010  # the site failed unexpectedly; the detail stays in its own log (P10)


class Refusal(Exception):
    """A site declines a request; becomes ``Message(Error(code, reason))`` in the ClientApp."""

    def __init__(self, code: RefusalCode, reason: str) -> None:
        super().__init__(f"[{int(code)} {code.name}] {reason}")
        self.code = RefusalCode(code)
        self.reason = reason


# Metrics every train reply must carry (validated by the server).
# Exactly these: nothing that depends on private data beyond the DP-noised weights (P10).
REPLY_METRICS: tuple[str, ...] = (
    "sigma",
    "sample-rate",
    "steps",
    "site-epsilon",  # cumulative over the site's whole ledger (lifetime)
    "run-epsilon",  # cumulative over this federation's rows of the site's ledger
    "site-delta",
    "site-rounds",  # rounds in the site's whole ledger
    "seeded",
)

_SPEND = re.compile(r" \| site-epsilon=(\S+) run-epsilon=(\S+) site-rounds=(\d+)$")


def spend_suffix(*, site_epsilon: float, run_epsilon: float, site_rounds: int) -> str:
    """What every refusal reason ends with: the site's spend from its own ledger (never private data)."""
    return f" | site-epsilon={float(site_epsilon)!r} run-epsilon={float(run_epsilon)!r} site-rounds={int(site_rounds)}"


def parse_spend_suffix(reason: str) -> tuple[str, dict[str, float] | None]:
    """(reason without the suffix, {"site-epsilon", "run-epsilon", "site-rounds"} or None if absent/invalid)."""
    match = _SPEND.search(reason or "")
    if match is None:
        return reason, None
    try:
        values = {"site-epsilon": float(match[1]), "run-epsilon": float(match[2]), "site-rounds": float(match[3])}
    except ValueError:
        return reason, None
    if not all(math.isfinite(v) and v >= 0 for v in values.values()):
        return reason, None
    return reason[: match.start()], values


def _require(rec: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if key not in rec:
        raise ValueError(f"{what}: missing key {key!r}")
    value = rec[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ValueError(f"{what}: {key}={value!r} must be {kind}, not a bool")
    if not isinstance(value, kind):
        raise ValueError(f"{what}: {key}={value!r} has type {type(value).__name__}, expected {kind}")
    return value


TRAIN_REQUEST_KEYS = ("federation", "round", "site", "sigma", "sample-rate", "steps", "basis-version", "basis-mode",
                      "fedpose-config")


@dataclass(frozen=True, kw_only=True)
class TrainRequest:
    """One round of local training, as asked by the server.

    ``config`` is the federation's training protocol (model, input size,
    method, strategy, batch sizes, optimizer, clip norm, psi, k, m). The
    site takes its privacy budget (epsilon, delta, accountant) from its own
    policy, never from here (P6).
    """

    federation: str
    round: int
    site: str
    sigma: float
    sample_rate: float  # the q the server planned with: must equal the site's own (P11)
    steps: int
    basis_version: int  # 0: the method does not project
    basis_mode: str
    config: Config

    def __post_init__(self) -> None:
        if not self.federation or not self.site:
            raise ValueError("train request: federation and site must be non-empty")
        if self.round < 1 or self.steps < 1:
            raise ValueError(f"train request: round={self.round} and steps={self.steps} must be >= 1")
        if not (self.sigma >= 0 and math.isfinite(self.sigma)):
            raise ValueError(f"train request: sigma={self.sigma!r} must be finite and >= 0")
        if not (0 < self.sample_rate <= 1):
            raise ValueError(f"train request: sample_rate={self.sample_rate!r} must be in (0, 1]")
        if self.basis_version < 0:
            raise ValueError(f"train request: basis_version={self.basis_version} must be >= 0")
        if self.basis_mode not in BASIS_MODES:
            raise ValueError(f"train request: basis_mode={self.basis_mode!r} not in {BASIS_MODES}")

    def to_record(self) -> Any:
        from flwr.app import ConfigRecord

        return ConfigRecord(
            {
                "federation": self.federation,
                "round": self.round,
                "site": self.site,
                "sigma": float(self.sigma),
                "sample-rate": float(self.sample_rate),
                "steps": self.steps,
                "basis-version": self.basis_version,
                "basis-mode": self.basis_mode,
                "fedpose-config": json.dumps(to_dict(self.config)),
            }
        )

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> TrainRequest:
        """Parse and validate; any problem raises ValueError naming the field."""
        what = "train request"
        unknown = sorted(set(rec) - set(TRAIN_REQUEST_KEYS))
        if unknown:
            raise ValueError(f"{what}: unknown field {unknown[0]!r}")
        try:
            data = json.loads(_require(rec, "fedpose-config", str, what))
        except json.JSONDecodeError as err:
            raise ValueError(f"{what}: fedpose-config is not JSON: {err}") from err
        return cls(
            federation=_require(rec, "federation", str, what),
            round=_require(rec, "round", int, what),
            site=_require(rec, "site", str, what),
            sigma=float(_require(rec, "sigma", (int, float), what)),
            sample_rate=float(_require(rec, "sample-rate", (int, float), what)),
            steps=_require(rec, "steps", int, what),
            basis_version=_require(rec, "basis-version", int, what),
            basis_mode=_require(rec, "basis-mode", str, what),
            config=config_from_dict(data),
        )


@dataclass(frozen=True, kw_only=True)
class SiteInfo:
    """A site's answer to the server's query: what its policy declares public, and its spend so far.

    Everything here comes from the site's policy file and its ledger, never
    from its private data (P10): no n (the sample rate is the policy's own).
    ``min_sigma`` is the smallest noise multiplier the site accepts (its own
    derivation, P6); the server plans at least that much. ``epsilon_spent``
    and ``rounds_done`` are cumulative over the site's whole ledger.
    """

    site: str
    epsilon: float
    delta: float
    lifetime_rounds: int
    rounds_per_federation: int
    rounds_done: int
    epsilon_spent: float
    min_sigma: float
    sample_rate: float
    steps_per_round: int
    clip_norm: float
    psi: str
    psi_min: float
    augment: bool
    accountant: str
    methods: tuple[str, ...]
    # Issue #11: the privacy unit the site trains at and its records cap (None: none stated). Optional on the
    # wire: a site of before has neither key, and meant record level.
    unit: str = "record"
    max_records_per_patient: int | None = None

    _KEYS = {
        "site": ("site", str), "epsilon": ("epsilon", (int, float)), "delta": ("delta", (int, float)),
        "lifetime_rounds": ("lifetime-rounds", int), "rounds_per_federation": ("rounds-per-federation", int),
        "rounds_done": ("rounds-done", int), "epsilon_spent": ("epsilon-spent", (int, float)),
        "min_sigma": ("min-sigma", (int, float)), "sample_rate": ("sample-rate", (int, float)),
        "steps_per_round": ("steps-per-round", int), "clip_norm": ("clip-norm", (int, float)),
        "psi": ("psi", str), "psi_min": ("psi-min", (int, float)), "augment": ("augment", bool),
        "accountant": ("accountant", str),
    }

    def to_record(self) -> Any:
        from flwr.app import ConfigRecord

        values = {key: getattr(self, name) for name, (key, _) in self._KEYS.items()}
        values["unit"] = self.unit
        if self.max_records_per_patient is not None:
            values["max-records-per-patient"] = self.max_records_per_patient
        return ConfigRecord({**values, "methods": list(self.methods)})

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> SiteInfo:
        what = "site info"
        methods = _require(rec, "methods", list, what)
        if not all(isinstance(m, str) for m in methods):
            raise ValueError(f"{what}: methods must be a list of strings, got {methods!r}")
        values: dict[str, Any] = {}
        for name, (key, kind) in cls._KEYS.items():
            value = _require(rec, key, kind, what)
            values[name] = float(value) if kind == (int, float) else value
        unit = rec.get("unit", "record")
        if unit not in ("record", "patient"):
            raise ValueError(f"{what}: unit={unit!r} must be 'record' or 'patient'")
        cap = rec.get("max-records-per-patient")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"{what}: max-records-per-patient={cap!r} must be an int >= 1")
        info = cls(**values, methods=tuple(methods), unit=unit, max_records_per_patient=cap)
        numbers = (info.epsilon, info.delta, info.epsilon_spent, info.min_sigma, info.sample_rate, info.clip_norm,
                   info.psi_min)
        if (not all(math.isfinite(v) for v in numbers) or not info.epsilon > 0 or not 0 < info.delta < 1
                or not 0 < info.sample_rate <= 1 or info.steps_per_round < 1 or info.lifetime_rounds < 1
                or info.rounds_per_federation < 1 or info.rounds_done < 0 or info.min_sigma <= 0):
            raise ValueError(f"{what}: implausible values {info}")
        return info


# ---------------------------------------------------------------------------
# arrays
# ---------------------------------------------------------------------------


def weights_record(tensors: Mapping[str, torch.Tensor]) -> Any:
    """ArrayRecord of float32 tensors as one vector {"values": (n,) float32, "layout": JSON [[name, shape]...]}.

    One array, not one per tensor: Flower moves every array as objects of its own, each pulled with a request
    of its own (signed, over TLS), so a model of 200 tensors took 200 round trips per message and direction.
    """
    from flwr.app import Array, ArrayRecord

    layout, parts = [], []
    for name, value in tensors.items():
        if value.dtype != torch.float32:
            raise ValueError(f"weights are float32; {name} is {value.dtype}")
        layout.append([name, list(value.shape)])
        parts.append(value.detach().reshape(-1).cpu())
    values = torch.cat(parts).numpy() if parts else np.zeros(0, dtype=np.float32)
    encoded = np.frombuffer(json.dumps(layout).encode(), dtype=np.uint8)
    return ArrayRecord({WEIGHTS_VALUES: Array(values), WEIGHTS_LAYOUT: Array(encoded.copy())})


def record_tensors(rec: Any) -> dict[str, torch.Tensor]:
    """ArrayRecord from ``weights_record`` -> {name: tensor} (numpy deserialisation, never pickle); a record
    that is not exactly that (other keys, a layout that is not names and shapes, sizes that do not add up)
    raises ValueError."""
    keys = set(rec.keys())
    if keys != {WEIGHTS_VALUES, WEIGHTS_LAYOUT}:
        raise ValueError(f"weights record must hold exactly {WEIGHTS_VALUES!r} and {WEIGHTS_LAYOUT!r}, "
                         f"got {sorted(keys)[:4]}")
    values, encoded = rec[WEIGHTS_VALUES].numpy(), rec[WEIGHTS_LAYOUT].numpy()
    if values.dtype != np.float32 or values.ndim != 1 or encoded.dtype != np.uint8 or encoded.ndim != 1:
        raise ValueError("weights record: values must be a float32 vector and the layout a uint8 vector")
    try:
        layout = json.loads(encoded.tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"weights layout is not JSON: {err}") from err
    if not isinstance(layout, list) or not all(
            isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in item[1]) for item in layout):
        raise ValueError("weights layout must be a list of [name, shape] with non-negative integer sizes")
    names = [name for name, _ in layout]
    if len(set(names)) != len(names):
        raise ValueError("weights layout names a tensor twice")
    sizes = [math.prod(shape) for _, shape in layout]
    if sum(sizes) != values.size:
        raise ValueError(f"weights layout covers {sum(sizes)} values, the record holds {values.size}")
    flat = torch.from_numpy(np.array(values, copy=True))
    return {name: part.view(shape) for (name, shape), part in zip(layout, flat.split(sizes))}


def basis_record(basis: torch.Tensor, *, version: int, dtype: str) -> Any:
    """V (p x k) as an ArrayRecord {"V": (p, k) dtype, "version": (1,) int64}.

    float16 halves the downlink; its rounding (relative 2^-11) keeps
    V^T V within about 1e-3 of I, which the site checks.
    """
    from flwr.app import Array, ArrayRecord

    if dtype not in BASIS_DTYPES:
        raise ValueError(f"basis dtype {dtype!r} not in {BASIS_DTYPES}")
    if basis.dim() != 2:
        raise ValueError(f"basis must be (p, k), got shape {tuple(basis.shape)}")
    matrix = basis.detach().cpu().numpy().astype(np.dtype(dtype))  # (p, k)
    return ArrayRecord(
        {BASIS_MATRIX: Array(matrix), BASIS_VERSION: Array(np.array([version], dtype=np.int64))}
    )


def record_basis(rec: Any) -> tuple[int, torch.Tensor]:
    """ArrayRecord -> (version, V as float32 (p, k), its columns contiguous); malformed records raise ValueError."""
    keys = set(rec.keys())
    if keys != {BASIS_MATRIX, BASIS_VERSION}:
        raise ValueError(f"basis record must hold exactly {BASIS_MATRIX!r} and {BASIS_VERSION!r}, got {sorted(keys)}")
    version = rec[BASIS_VERSION].numpy()
    if version.shape != (1,) or version.dtype.kind not in "iu":
        raise ValueError(f"basis version must be one integer, got {version!r}")
    matrix = rec[BASIS_MATRIX].numpy()
    if matrix.dtype.name not in BASIS_DTYPES:
        raise ValueError(f"basis dtype {matrix.dtype} not in {BASIS_DTYPES}")
    # column by column whatever the sender's layout: the layout a step projects with (subspace.column_major)
    return int(version[0]), torch.from_numpy(np.asfortranarray(matrix, dtype=np.float32))


def payload_bytes(content: Any) -> int:
    """Bytes of a RecordDict as serialised: arrays (ArrayRecord.count_bytes) + configs/metrics (JSON)."""
    total = 0
    for rec in content.array_records.values():
        total += rec.count_bytes()
    for rec in list(content.config_records.values()) + list(content.metric_records.values()):
        total += len(json.dumps(dict(rec), default=str).encode())
    return total
