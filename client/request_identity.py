"""What a round's release is a function of besides the private data and its noise (P16): the digest of the whole
request (``request_digest``) and the app bundle that runs it (``running_bundle``).

A charged round's ledger row is bound to this digest (``fedpose.client.ledger``): only the identical request,
run by the same bundle, replays a round whose process died; any other is refused, never trained on its noise.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

# Set by the site's app gate (client.app_trust) to the digest of the approved bundle it checked and installed.
BUNDLE_ENV = "FEDPOSE_APP_DIGEST"


def running_bundle() -> str:
    """The app bundle this round runs under: the digest the site's gate checked, or ``unbundled`` (simulation, a
    direct call), which is the site's installed code."""
    return os.environ.get(BUNDLE_ENV) or "unbundled"


def request_digest(content: Any, basis: torch.Tensor | None, *, bundle: str) -> str:
    """SHA-256 of everything a round's release is a function of besides the private data and its noise (P16).

    Every record of the request in a canonical order (the weights, a basis sent with it, every config field),
    the basis V the round will project with (sent, cached or computed: its bytes), and the app bundle that runs
    it. A charged round is bound to this digest: only the identical request replays it after a crash.
    """
    h = hashlib.sha256(b"fedpose-request-v1\0")

    def put(*parts: Any) -> None:
        for part in parts:
            data = part if isinstance(part, (bytes, memoryview)) else repr(part).encode()
            h.update(len(data).to_bytes(8, "big") if isinstance(data, bytes) else data.nbytes.to_bytes(8, "big"))
            h.update(data)

    for name in sorted(content.keys()):
        record = content[name]
        put("record", name, type(record).__name__)
        for key in sorted(record.keys()):
            value = record[key]
            if hasattr(value, "data") and hasattr(value, "shape"):  # an Array
                put(key, value.dtype, tuple(value.shape), value.stype, value.data)
            else:
                put(key, type(value).__name__, value)
    if basis is None:
        put("basis", None)
    else:
        # V^T row by row: no copy for the column-by-column V a site projects with (client.site_basis)
        vt = basis.detach().to("cpu", torch.float32).t().contiguous()
        # numpy's stubs give ndarray the buffer protocol (__buffer__) on Python >= 3.12 only
        put("basis", tuple(vt.shape), memoryview(vt.numpy()).cast("B"))  # type: ignore[arg-type]
    put("bundle", bundle)
    return h.hexdigest()
