"""Reject site replies that must not be averaged in (NaN/Inf, wrong shapes, missing metrics).

A rejected reply is logged and recorded as an event, never aggregated. Its
spend is still recorded when the metrics that describe it (sigma, q, steps)
are themselves valid: the site ran those steps whatever came back.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedpose.shared.flower.messages import ARRAYS, METRICS, REPLY_METRICS, record_tensors

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ran:
    """What a site says it ran (the accountant's input) and its own epsilon."""

    sigma: float
    sample_rate: float
    steps: int
    site_epsilon: float  # lifetime
    run_epsilon: float  # this federation
    site_rounds: int


def _number(metrics: Mapping[str, Any], key: str) -> float:
    if key not in metrics:
        raise ValueError(f"reply metrics lack {key!r}")
    value = metrics[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"reply metric {key}={value!r} is not a finite number")
    return float(value)


def _integer(metrics: Mapping[str, Any], key: str) -> int:
    value = _number(metrics, key)
    if value != int(value):
        raise ValueError(f"reply metric {key}={value!r} is not an integer")
    return int(value)


def parse_ran(content: Any) -> Ran:
    """The spend a reply describes; ValueError when it does not describe one completely."""
    if METRICS not in content.metric_records:
        raise ValueError("reply has no metrics record")
    metrics = content[METRICS]
    missing = [k for k in REPLY_METRICS if k not in metrics]
    if missing:
        raise ValueError(f"reply metrics lack {missing}")
    ran = Ran(
        sigma=_number(metrics, "sigma"),
        sample_rate=_number(metrics, "sample-rate"),
        steps=_integer(metrics, "steps"),
        site_epsilon=_number(metrics, "site-epsilon"),
        run_epsilon=_number(metrics, "run-epsilon"),
        site_rounds=_integer(metrics, "site-rounds"),
    )
    extra = sorted(set(metrics) - set(REPLY_METRICS))
    if extra:
        raise ValueError(f"reply metrics carry unexpected keys {extra[:3]}")
    delta = _number(metrics, "site-delta")
    if not 0 < delta < 1:
        raise ValueError(f"reply site-delta={delta} must be in (0, 1)")
    if not ran.sigma > 0:
        raise ValueError(f"reply sigma={ran.sigma} must be > 0")
    if not 0 < ran.sample_rate <= 1:
        raise ValueError(f"reply sample-rate={ran.sample_rate} must be in (0, 1]")
    if ran.steps < 1 or ran.site_rounds < 1:
        raise ValueError(f"reply steps={ran.steps} and site-rounds={ran.site_rounds} must be >= 1")
    if ran.site_epsilon < 0 or ran.run_epsilon < 0 or ran.run_epsilon > ran.site_epsilon * (1 + 1e-9):
        raise ValueError(f"reply site-epsilon={ran.site_epsilon} and run-epsilon={ran.run_epsilon} must be >= 0, "
                         "the run's at most the lifetime's")
    for key in REPLY_METRICS:
        _number(metrics, key)
    return ran


def update_norm(weights: Mapping[str, torch.Tensor], global_weights: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of a site's update (its weights minus the global weights it was sent), in float64."""
    total = 0.0
    for name, value in weights.items():
        total += float((value.to(torch.float64) - global_weights[name].to(torch.float64)).pow(2).sum())
    return math.sqrt(total)


def parse_weights(content: Any, expected: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The reply's trainable tensors; exactly the expected names and shapes, floating point, all finite."""
    if ARRAYS not in content.array_records:
        raise ValueError("reply has no weights")
    try:
        tensors = record_tensors(content[ARRAYS])
    except (ValueError, TypeError) as err:
        raise ValueError(f"reply weights cannot be read: {err}") from err
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(f"reply weights: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"reply weight {name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
        if not tensor.is_floating_point():
            raise ValueError(f"reply weight {name} has dtype {tensor.dtype}, expected floating point")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"reply weight {name} contains NaN or Inf")
    return {k: v.to(torch.float32) for k, v in tensors.items()}
