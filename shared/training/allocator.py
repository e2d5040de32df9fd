"""Keep a training process's freed memory for its next step.

A training step allocates and frees the same tensors of tens of MB again and again (activations, per-sample
norms' inputs, the noise, the summed gradient). glibc's malloc serves a block that large with its own mapping,
gives it back to the OS when it is freed, and takes it again on the next step, zero-filled one 4 KB page
fault at a time: on a 2-core CPU site that is about a tenth of a DP step, and it falls more on the private
step, which holds more such tensors. ``keep_freed_memory`` raises glibc's mapping threshold to its maximum
(32 MB) and stops it from returning the top of the heap to the OS, so the freed blocks are reused.

The process keeps its peak heap for its lifetime, which a training process reaches every step anyway. It
changes no value any tensor holds. Called by ``fedpose.shared.training.loop.local_train`` and ``public_basis_at``; on a
system without glibc (macOS, musl) it does nothing and says so with its return value.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest mapping threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1 << 30  # free memory at the top of the heap kept before any is given back

_kept: bool | None = None


def keep_freed_memory() -> bool:
    """Make this process reuse its freed blocks instead of giving them back to the OS; True when applied.

    Idempotent and process-wide. False (and nothing changed) where the C library is not glibc.
    """
    global _kept
    if _kept is not None:
        return _kept
    _kept = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            mallopt = None
        if mallopt is not None and hasattr(libc, "gnu_get_libc_version"):
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _kept = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                      TRIM_THRESHOLD))
    if not _kept:
        log.debug("the C library is not glibc: freed memory is managed as the system does")
    return _kept
