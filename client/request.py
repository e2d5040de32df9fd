"""A train request: parsed, checked against what the site's policy pins (P11) and against its resource
bounds (P13), and its weights loaded or refused; reads no private data. Then what the request's release is a
function of besides the private data and its noise (P16): the digest of the whole request (``request_digest``)
and the app bundle that runs it (``running_bundle``).

A charged round's ledger row is bound to this digest (``fedpose.client.ledger``): only the identical request,
run by the same bundle, replays a round whose process died; any other is refused, never trained on its noise.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

import torch

from fedpose.client.policy import SitePolicy, sigma_shortfall
from fedpose.shared.privacy.step.psi import psi_strength, psi_label_of
from fedpose.shared.flower.messages import ARRAYS, CONFIG, Refusal, RefusalCode, TrainRequest, record_tensors
from fedpose.shared.configuration.methods import WITH_PUBLIC, raw_psi_conflict

_FEDERATION_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def parse_request(content: Any) -> TrainRequest:
    try:
        return TrainRequest.from_record(content[CONFIG])
    except (KeyError, ValueError, TypeError, OverflowError) as err:
        raise Refusal(RefusalCode.BAD_REQUEST, f"malformed train request: {err}") from err


def check_request(request: TrainRequest, policy: SitePolicy) -> None:
    """Refuse (POLICY / WEAKER_NOISE) a request weaker than what the policy pins (P11); reads no private data."""
    cfg = request.config
    method = cfg.train.method
    if request.site != policy.site:
        raise Refusal(RefusalCode.BAD_REQUEST, f"request is for site {request.site!r}, this is {policy.site!r}")
    if not _FEDERATION_ID.match(request.federation):
        raise Refusal(RefusalCode.BAD_REQUEST, "federation id must be 1-64 letters, digits, '.', '_' or '-'")
    if cfg.train.tensor_scales != "none":  # read from the public split at every refresh: a site does not hold it
        raise Refusal(RefusalCode.BAD_REQUEST, f"train.tensor_scales={cfg.train.tensor_scales!r} is for centralized "
                                               "runs only: a site trains without the public split")
    if cfg.train.optimizer == "public-adam":  # its second moment is read from the public split at every step
        raise Refusal(RefusalCode.BAD_REQUEST, "train.optimizer='public-adam' is for centralized runs only: a site "
                                               "trains without the public split its second moment is read from")
    if cfg.privacy.noise_multiplier is not None:  # 0 would be no noise at all: this site plans its own sigma
        raise Refusal(RefusalCode.BAD_REQUEST, f"privacy.noise_multiplier={cfg.privacy.noise_multiplier!r} is a "
                                               "centralized diagnostic; a site's noise comes from its own budget")
    if cfg.train.strategy == "lora":  # adapters are made and merged inside one centralized run
        raise Refusal(RefusalCode.BAD_REQUEST, "train.strategy='lora' is for centralized runs only: its adapters live "
                                               "inside one run, and a round trains the weights it was sent")
    conflict = raw_psi_conflict(cfg.train.images, method, cfg.privacy.unit, cfg.privacy.augment_multiplicity)
    if conflict:  # the run would refuse it after the charge
        raise Refusal(RefusalCode.BAD_REQUEST, conflict)
    if method not in policy.allowed_methods:
        raise Refusal(RefusalCode.POLICY,
                      f"method {method!r} is not allowed by this site (allows {list(policy.allowed_methods)})")
    extra = [t for t in cfg.model.face_tasks if t not in policy.face_tasks]
    if extra:  # their labels would be used (and, under Feature-DP, treated as public) without the operator's say
        raise Refusal(RefusalCode.POLICY, f"face tasks {extra} are not allowed by this site (allows "
                                          f"{list(policy.face_tasks)})")
    if cfg.privacy.unit != policy.unit:  # its q, clipping and claim are per unit (issue #11)
        raise Refusal(RefusalCode.POLICY, f"privacy unit {cfg.privacy.unit!r} is not this site's {policy.unit!r}")
    if request.sample_rate != policy.sample_rate:
        raise Refusal(RefusalCode.POLICY, f"sample rate {request.sample_rate!r} is not this site's "
                                          f"{policy.sample_rate!r}")
    if request.steps > policy.steps_per_round:
        raise Refusal(RefusalCode.POLICY, f"{request.steps} local steps exceed this site's steps_per_round="
                                          f"{policy.steps_per_round}")
    if cfg.privacy.clip_norm != policy.clip_norm:
        raise Refusal(RefusalCode.POLICY, f"clip norm {cfg.privacy.clip_norm!r} is not this site's "
                                          f"{policy.clip_norm!r}")
    h, w = cfg.data.input_size
    if h > policy.max_input_size[0] or w > policy.max_input_size[1]:
        raise Refusal(RefusalCode.POLICY, f"input size {h}x{w} exceeds this site's max_input_size "
                                          f"{policy.max_input_size[0]}x{policy.max_input_size[1]}")
    if cfg.privacy.augment_multiplicity != policy.augment_multiplicity:  # a round's cost is the site's (P13)
        raise Refusal(RefusalCode.POLICY, f"augment_multiplicity={cfg.privacy.augment_multiplicity} is not this "
                                          f"site's augment_multiplicity={policy.augment_multiplicity}")
    asked = cfg.privacy.chunk_memory
    if asked is not None and (policy.chunk_memory is None or asked > policy.chunk_memory):  # memory is the site's
        allows = (f"allows chunk_memory={policy.chunk_memory:g}, at most its chunk_size rows" if policy.chunk_memory
                  else "sizes no chunk from its free memory: every chunk is its chunk_size rows")
        raise Refusal(RefusalCode.POLICY, f"privacy.chunk_memory={asked:g} asks for more of this site's memory than "
                                          f"its policy allows (it {allows})")
    if cfg.data.augment != policy.augment:
        raise Refusal(RefusalCode.POLICY, f"augment={cfg.data.augment} but this site's policy says "
                                          f"augment={policy.augment}")
    if method in WITH_PUBLIC:
        if cfg.train.public_batch_size != policy.public_batch_size:  # P17: what each step's draw shows is pinned
            raise Refusal(RefusalCode.POLICY, f"public batch size {cfg.train.public_batch_size} is not this site's "
                                              f"public_batch_size={policy.public_batch_size}")
        if cfg.privacy.psi != policy.psi:
            raise Refusal(RefusalCode.POLICY, f"psi {cfg.privacy.psi!r} is not this site's {policy.psi!r}")
        strength = psi_strength(cfg.privacy.psi, cfg.privacy.psi_param, cfg.data.input_size)
        if not strength >= policy.psi_min:
            label = psi_label_of(cfg.privacy)
            raise Refusal(RefusalCode.POLICY, f"psi {label} has strength {strength:.4g} of min(H, W), below "
                                              f"this site's psi_min="
                                              f"{policy.psi_min:g}")
    shortfall = sigma_shortfall(policy, sigma=request.sigma)
    if shortfall is not None:
        raise Refusal(RefusalCode.WEAKER_NOISE, shortfall)


def check_model_size(model: torch.nn.Module, policy: SitePolicy) -> None:
    """Refuse a model larger than the policy's ``max_parameters``: memory is the site's to pin (P13)."""
    count = sum(t.numel() for t in model.state_dict().values())
    if count > policy.max_parameters:
        raise Refusal(RefusalCode.POLICY, f"the requested model has {count:,} parameters, more than this site's "
                                          f"max_parameters={policy.max_parameters:,}")


def load_weights(content: Any, model: torch.nn.Module) -> None:
    """Load the global weights into ``model`` or refuse: exactly its tensors, its shapes, all finite."""
    if ARRAYS not in content.array_records:
        raise Refusal(RefusalCode.BAD_REQUEST, "train request carries no weights")
    expected = model.state_dict()
    try:
        tensors = record_tensors(content[ARRAYS])
    except (ValueError, TypeError) as err:
        raise Refusal(RefusalCode.BAD_REQUEST, f"weights cannot be read: {err}") from err
    if set(tensors) != set(expected):
        raise Refusal(RefusalCode.BAD_REQUEST, "weights do not fit the model: names differ "
                                               f"(missing {sorted(set(expected) - set(tensors))[:3]}, "
                                               f"unexpected {sorted(set(tensors) - set(expected))[:3]})")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise Refusal(RefusalCode.BAD_REQUEST, f"weights do not fit the model: {name} has shape "
                                                   f"{tuple(tensor.shape)}, expected {tuple(expected[name].shape)}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise Refusal(RefusalCode.BAD_REQUEST, f"weights contain NaN or Inf ({name})")
    model.load_state_dict(tensors, strict=True)


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
        # V^T row by row: no copy for the column-by-column V a site projects with (client.basis)
        vt = basis.detach().to("cpu", torch.float32).t().contiguous()
        # numpy's stubs give ndarray the buffer protocol (__buffer__) on Python >= 3.12 only
        put("basis", tuple(vt.shape), memoryview(vt.numpy()).cast("B"))  # type: ignore[arg-type]
    put("bundle", bundle)
    return h.hexdigest()
