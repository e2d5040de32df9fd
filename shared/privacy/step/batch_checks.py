"""What every private-step function checks of its inputs: a batch dict of tensors that share their leading
dimension, a dict of floating-point trainable tensors, a positive chunk size."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor


def batch_size_of(batch: Mapping[str, Tensor]) -> int:
    """Return the common leading dimension B of a batch dict, validating it.

    Every value must be a tensor with at least one dimension, and all must
    agree on B, otherwise per-sample slicing would silently pair sample i of
    one tensor with sample j of another.
    """
    if not isinstance(batch, Mapping) or len(batch) == 0:
        raise ValueError(
            f"batch must be a non-empty dict of batched tensors, got {type(batch).__name__} "
            f"of length {len(batch) if isinstance(batch, Mapping) else 'n/a'}"
        )
    sizes = {}
    for name, value in batch.items():
        if not isinstance(value, Tensor):
            raise ValueError(
                f"batch[{name!r}] is a {type(value).__name__}, not a Tensor: "
                "keep only batched tensors in the batch dict"
            )
        if value.dim() == 0:
            raise ValueError(
                f"batch[{name!r}] is a 0-d tensor: every batch tensor needs a leading "
                "batch dimension"
            )
        sizes[name] = int(value.shape[0])
    distinct = set(sizes.values())
    if len(distinct) != 1:
        raise ValueError(f"batch tensors disagree on the batch size: {sizes}")
    return distinct.pop()


def check_params(params: Mapping[str, Tensor]) -> None:
    """Refuse anything but a non-empty dict of floating point tensors."""
    if not isinstance(params, Mapping) or len(params) == 0:
        raise ValueError("params must be a non-empty dict of trainable tensors")
    for name, value in params.items():
        if not isinstance(value, Tensor) or not value.is_floating_point():
            found = value.dtype if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"params[{name!r}] must be a floating point Tensor, got {found}: pass "
                "only the trainable parameters"
            )


def check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"chunk_size={chunk_size!r} must be a positive int (samples per vmap call; "
            "lower it to save memory)"
        )
