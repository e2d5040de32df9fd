"""A site's own privacy policy (P6, P11): a YAML file the hospital controls, not the server.

Everything that decides the site's guarantee is pinned here, so a hostile
server can only ask for it, never choose it (docs/explanation/design.md: threat model)::

    policy_version: 3
    site: hospital-a
    # budget (over the ledger's whole life: every federation the site ever joins)
    epsilon: 0.8
    delta: 1e-5                   # must be < 1/n for its n records
    lifetime_rounds: 20           # rounds over the ledger's whole life
    rounds_per_federation: 5      # rounds in any one federation (run)
    min_sigma: null               # null: derived from epsilon, delta, q, steps_per_round, lifetime_rounds
    # mechanism
    methods: [dpsgd, proj]        # the record-level methods (the default); nonprivate is never accepted
    release_blurred_images_and_labels: false   # true: opt in to Feature-DP (fdp, fpdp), see below
    public_batch_size: 32         # fdp/fpdp: records whose psi(x) and labels each step uses without noise
    public_records: null          # fdp/fpdp: draw them from a fixed set of this many records (null: from all)
    sample_rate: 0.16             # Poisson rate q of the private batch (public: the server's accountant uses it)
    expected_batch: 64            # B, the public constant the noisy sum is divided by (P15): about q x n
    steps_per_round: 10           # at most this many local steps per round
    clip_norm: 1.0                # per-sample clip C
    psi: blur                     # fdp/fpdp: the feature map treated as public
    psi_min: 0.03                 # its minimum strength, a fraction of min(H, W): blur sigma or pixelate block
    augment: true                 # whether private batches are augmented (psi always sees the canonical crop)
    augment_multiplicity: 1       # augmented copies of each sampled record (a request for another is refused)
    unit: record                  # the privacy unit: record (one image) or patient (all images of one person)
    max_records_per_patient: 8    # patient: records of a patient used (a fixed subset); record: the stated cap
                                  # of the group-privacy bound in the claim (checked against the data's patient ids)
    # data
    data_path: data/site-0        # split directory (annotations.json, images/)
    ledger_path: ledger.sqlite    # the site's durable spend ledger
    public_path: data/public      # its copy of the public set (basis_mode "site")
    public_digest: 9f2c...        # manifest digest of that public set, approved by the operator
    eval_path: data/site-0-eval   # optional held-out split: the site evaluates each global model on it, locally
    accountant: rdp
    # resources and timing (P13: nothing the server chooses makes them depend on the private data)
    chunk_size: 16                # per-sample gradients held in memory at a time (with chunk_memory: the most)
    chunk_memory: null            # a share of the free (GPU) memory, in (0, 1), the chunks may hold: the site then
                                  # runs the most rows at a time that fit it, at most chunk_size (null: chunk_size)
    max_parameters: 20000000      # the largest model (all its tensors) a request may send
    max_input_size: [256, 256]    # the largest model input (H, W) a request may ask for
    round_seconds: null           # a reply leaves this many seconds after its request arrived (null: when done);
                                  # a request whose worst case does not fit it is refused (fedpose.client.capacity)
    face_tasks: []                # face tasks trained on the site's face labels (public under fdp/fpdp)

Relative paths are relative to the policy file's directory. A request that
asks for anything weaker than this is refused with nothing trained and
nothing spent; a policy written before version 2 is refused with a message
that says what to add; so is a version-2 policy, which did not pin the
normaliser (``expected_batch``).

``sample_rate`` and ``expected_batch`` are public constants: the server's
accountant needs q, and B divides the noisy sum. An operator who sets
B = q x n reveals n (approximately) through them, which the claim names;
``fedpose site-policy --expected-batch B`` computes q = B / n from the site's
data when the policy is written, once, not per round.

Feature-DP is an explicit opt-in (P17): under fdp/fpdp the server reads, exactly, psi(x) and the labels of
the ``public_batch_size`` records a step draws (without replacement, never more than the site holds), so
they are allowed only with ``release_blurred_images_and_labels: true``; ``methods`` then defaults to all four.
Each step draws afresh, so over a federation the server sees every record the draws reach and can count them:
from all the site's records by default, or, with ``public_records: m``, from a fixed set of m records that the
site's check chooses (by content hash: the same set on every check of the same data), so that the draws show
those m records at most and not how many the site holds (``what_the_draws_show`` says which, in words).

Privacy unit. ``unit`` and ``max_records_per_patient`` are optional version-2 fields: a policy without them
means exactly what it meant before (record level, no cap stated), so the version is not bumped. At patient
level ``sample_rate`` is q_p, the Poisson rate over PATIENTS (expected patients per step / patients at the
site), the data must carry patient ids, delta must be below 1 / patients, and a request for the other unit is
refused (either way: a site's q means one unit). The cap is the site's own: a request's
``privacy.max_records_per_patient`` is not read.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedpose.shared.configuration.yaml_io import read_yaml
from fedpose.shared.privacy.accounting.accountant import ACCOUNTANTS, StepRecord, calibrate_sigma, epsilon_spent
from fedpose.shared.privacy.step.psi import PSI_KINDS
from fedpose.shared.configuration.methods import PRIVATE, RECORD_LEVEL, UNITS, WITH_PUBLIC

log = logging.getLogger(__name__)

POLICY_VERSION = 3
FILL_ME = "FILL-ME"  # what a kit's template leaves for the site to fill (each has a command that fills it)
# The opt-in line, as the refusal of a policy without it names it.
OPT_IN = "release_blurred_images_and_labels: true"
# What the public draws of a Feature-DP site without a fixed public set give a server over a whole federation.
DRAWS_SHOW_ALL = ("over a federation the server sees the blurred copy and labels of every record the public term "
                  "draws, and from the draws it can count them")

# What a version-1 policy must add (named in the refusal of an old file).
_V3_FIELDS = ("policy_version: 3", "expected_batch (the public normaliser B of the noisy sum: about sample_rate x "
              "the site's records; `fedpose site-policy --expected-batch B` writes a policy with it)")
_V2_FIELDS = ("policy_version: 2", "sample_rate", "steps_per_round", "clip_norm", "psi", "psi_min", "augment",
              "lifetime_rounds and rounds_per_federation (instead of max_rounds)",
              "public_digest (with public_path; `fedpose site-policy --check` prints it)")


def _positive(name: str, value: Any, *, upper: float | None = None) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 1000:
        raise ValueError(f"site policy: {name} is too large to be a number")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"site policy: {name}={value!r} must be a finite number > 0")
    if upper is not None and value > upper:
        raise ValueError(f"site policy: {name}={value!r} must be <= {upper:g}")


def _count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"site policy: {name}={value!r} must be an int >= 1")


@dataclass(frozen=True, kw_only=True)
class SitePolicy:
    site: str
    epsilon: float
    delta: float
    lifetime_rounds: int
    rounds_per_federation: int
    sample_rate: float
    steps_per_round: int
    clip_norm: float
    psi: str
    psi_min: float
    augment: bool
    data_path: str
    ledger_path: str
    expected_batch: float
    min_sigma: float | None = None
    public_path: str | None = None
    public_digest: str | None = None
    eval_path: str | None = None  # held-out split evaluated at the site only (client/evaluation.py)
    accountant: str = "rdp"
    # None: dpsgd and proj, or all four with the Feature-DP opt-in below (resolved in __post_init__)
    methods: tuple[str, ...] | None = None
    # Feature-DP's opt-in (P17): under fdp/fpdp the server can read psi(x) and the labels of every record drawn.
    release_blurred_images_and_labels: bool = False
    public_batch_size: int = 32
    # fdp/fpdp: the public term draws from a fixed set of this many records (the site's check chooses it); None: all
    public_records: int | None = None
    seed: int | None = None  # reproducible noise for tests only (P7: not for production)
    unit: str = "record"
    max_records_per_patient: int | None = None
    chunk_size: int = 16
    # the chunks sized from the free memory: this share of it, at most chunk_size rows (fedpose.shared.training.
    # chunk_memory); None: chunk_size rows. Not the server's: a request asking for more is refused.
    chunk_memory: float | None = None
    max_parameters: int = 20_000_000
    max_input_size: tuple[int, int] = (256, 256)
    round_seconds: float | None = None
    # K augmented copies per sampled record: a round's cost grows with it, so the site pins it (P13)
    augment_multiplicity: int = 1
    # Face tasks (model.face_tasks) this site trains on its face labels. Under fdp / fpdp those labels are used
    # without noise like the pose labels, so they are public by the claim; none unless the operator lists them.
    face_tasks: tuple[str, ...] = ()
    policy_version: int = POLICY_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.site, str) or not self.site.strip():
            raise ValueError("site policy: site must be a non-empty name")
        if self.policy_version == 2:
            raise ValueError("site policy: version 2 does not pin the normaliser of the noisy sum; add "
                             + "; ".join(_V3_FIELDS))
        if self.policy_version != POLICY_VERSION:
            raise ValueError(f"site policy: policy_version={self.policy_version!r}, this fedpose reads "
                             f"{POLICY_VERSION}")
        _positive("epsilon", self.epsilon)
        _positive("delta", self.delta)
        if not self.delta < 1:
            raise ValueError(f"site policy: delta={self.delta} must be in (0, 1), e.g. 1e-5")
        _positive("sample_rate", self.sample_rate, upper=1.0)
        _positive("expected_batch", self.expected_batch)
        _positive("clip_norm", self.clip_norm)
        _positive("psi_min", self.psi_min)
        for name in ("lifetime_rounds", "rounds_per_federation", "steps_per_round", "chunk_size", "max_parameters",
                     "augment_multiplicity"):
            _count(name, getattr(self, name))
        if self.rounds_per_federation > self.lifetime_rounds:
            raise ValueError(f"site policy: rounds_per_federation={self.rounds_per_federation} exceeds "
                             f"lifetime_rounds={self.lifetime_rounds}")
        if self.min_sigma is not None:
            _positive("min_sigma", self.min_sigma)
        if self.psi not in PSI_KINDS:
            raise ValueError(f"site policy: psi={self.psi!r} must be one of {list(PSI_KINDS)}")
        if not isinstance(self.augment, bool):
            raise ValueError(f"site policy: augment={self.augment!r} must be true or false")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"site policy: accountant={self.accountant!r} must be one of {ACCOUNTANTS}")
        if not isinstance(self.release_blurred_images_and_labels, bool):
            raise ValueError(f"site policy: release_blurred_images_and_labels="
                             f"{self.release_blurred_images_and_labels!r} must be true or false")
        methods = self.methods
        if methods is None:
            methods = PRIVATE if self.release_blurred_images_and_labels else RECORD_LEVEL
            object.__setattr__(self, "methods", methods)
        bad = [m for m in methods if m not in PRIVATE]
        if bad or not methods:
            raise ValueError(f"site policy: methods={list(methods)} must be a non-empty subset of "
                             f"{list(PRIVATE)} (nonprivate training is never accepted)")
        feature = [m for m in methods if m in WITH_PUBLIC]
        if feature and not self.release_blurred_images_and_labels:
            raise ValueError(f"site policy: methods {feature} are Feature-DP: with them the server can read, exactly, "
                             "a blurred copy of each image drawn for the public term and its pose labels; "
                             f"{what_the_draws_show(self)}. To opt in, add the line "
                             f"`{OPT_IN}`; otherwise list only {list(RECORD_LEVEL)}")
        _count("public_batch_size", self.public_batch_size)
        if self.public_records is not None:
            _count("public_records", self.public_records)
            if self.public_records < self.public_batch_size:
                raise ValueError(f"site policy: public_records={self.public_records} is smaller than public_batch_size="
                                 f"{self.public_batch_size}: each step draws that many distinct records of the set")
        for name in ("data_path", "ledger_path"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"site policy: {name} must be a path")
        if self.public_path and not self.public_digest:
            raise ValueError("site policy: public_path needs public_digest, the manifest digest of that public set "
                             "that this site's operator approved (`fedpose site-policy --check` prints it)")
        if self.public_digest is not None and (not isinstance(self.public_digest, str) or len(self.public_digest) != 64
                                               or any(c not in "0123456789abcdef" for c in self.public_digest)):
            raise ValueError(f"site policy: public_digest={self.public_digest!r} must be a sha256 hex digest")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"site policy: seed={self.seed!r} must be a non-negative int or null")
        if self.unit not in UNITS:
            raise ValueError(f"site policy: unit={self.unit!r} must be one of {list(UNITS)}")
        if self.max_records_per_patient is not None:
            _count("max_records_per_patient", self.max_records_per_patient)
        from fedpose.shared.configuration.schema import MAX_MULTIPLICITY
        if self.augment_multiplicity > MAX_MULTIPLICITY:
            raise ValueError(f"site policy: augment_multiplicity={self.augment_multiplicity} must be <= "
                             f"{MAX_MULTIPLICITY}")
        if self.augment_multiplicity > 1 and self.unit != "record":
            raise ValueError("site policy: augment_multiplicity > 1 is for unit: record (a patient's records are "
                             "averaged before clipping already)")
        sizes = self.max_input_size
        if len(sizes) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 32 for v in sizes):
            raise ValueError(f"site policy: max_input_size={list(self.max_input_size)!r} must be [H, W], each >= 32")
        if self.round_seconds is not None:
            _positive("round_seconds", self.round_seconds)
        if self.chunk_memory is not None:
            _positive("chunk_memory", self.chunk_memory)
            if not self.chunk_memory < 1:
                raise ValueError(f"site policy: chunk_memory={self.chunk_memory!r} must be a share of the free memory "
                                 "in (0, 1), e.g. 0.8")
        from fedpose.shared.data.face import FACE_TASKS, valid_face_tasks
        if not valid_face_tasks(self.face_tasks):
            raise ValueError(f"site policy: face_tasks={list(self.face_tasks)!r} must be distinct names from "
                             f"{list(FACE_TASKS)}")

    @property
    def allowed_methods(self) -> tuple[str, ...]:
        """``methods`` as ``__post_init__`` resolved it: never None on a constructed policy."""
        return self.methods or ()


_TYPES: dict[str, tuple[type, ...]] = {
    "policy_version": (int,),
    "site": (str,),
    "epsilon": (int, float),
    "delta": (int, float),
    "lifetime_rounds": (int,),
    "rounds_per_federation": (int,),
    "sample_rate": (int, float),
    "steps_per_round": (int,),
    "clip_norm": (int, float),
    "psi": (str,),
    "psi_min": (int, float),
    "augment": (bool,),
    "data_path": (str,),
    "ledger_path": (str,),
    "min_sigma": (int, float, type(None)),
    "public_path": (str, type(None)),
    "public_digest": (str, type(None)),
    "eval_path": (str, type(None)),
    "accountant": (str,),
    "methods": (list, tuple, type(None)),
    "release_blurred_images_and_labels": (bool,),
    "public_batch_size": (int,),
    "public_records": (int, type(None)),
    "seed": (int, type(None)),
    "unit": (str,),
    "max_records_per_patient": (int, type(None)),
    "expected_batch": (int, float),
    "chunk_size": (int,),
    "chunk_memory": (int, float, type(None)),
    "max_parameters": (int,),
    "max_input_size": (list, tuple),
    "round_seconds": (int, float, type(None)),
    "augment_multiplicity": (int,),
    "face_tasks": (list, tuple),
}
_FLOATS = ("epsilon", "delta", "sample_rate", "expected_batch", "clip_norm", "psi_min", "min_sigma", "round_seconds",
           "chunk_memory")


def policy_from_dict(data: dict[str, Any], *, base: Path | None = None) -> SitePolicy:
    """Validate plain data (unknown keys and wrong types rejected, naming the key); resolve paths against ``base``."""
    if not isinstance(data, dict):
        raise ValueError(f"site policy: expected a mapping, got {type(data).__name__}")
    if "policy_version" not in data:
        raise ValueError("site policy: this policy predates policy version 2 and pins too little of the "
                         "guarantee (a server could choose the rest); add " + "; ".join(_V2_FIELDS))
    if data["policy_version"] == 2:
        raise ValueError("site policy: this is a version-2 policy, which does not pin the normaliser of the noisy "
                         "sum (a server could read the site's size from its replies); add " + "; ".join(_V3_FIELDS))
    unfilled = [k for k, v in data.items() if v == FILL_ME]
    if unfilled:
        steps = {"data_path": "fedpose site set-data --policy POLICY DATA_DIR",
                 "sample_rate": "fedpose site set-data --policy POLICY DATA_DIR",
                 "public_path": "fedpose site approve-public --policy POLICY --digest DIGEST PUBLIC_DIR",
                 "public_digest": "fedpose site approve-public --policy POLICY --digest DIGEST PUBLIC_DIR"}
        todo = list(dict.fromkeys(steps.get(k, f"write {k} into the policy") for k in unfilled))
        raise ValueError(f"site policy: {', '.join(unfilled)} still say {FILL_ME}; run: " + "; then ".join(todo))
    names = {f.name for f in dataclasses.fields(SitePolicy)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"site policy: unknown key {unknown[0]!r} (known: {', '.join(sorted(names))})")
    missing = sorted(
        f.name for f in dataclasses.fields(SitePolicy)
        if f.default is dataclasses.MISSING and f.name not in data
    )
    if missing:
        raise ValueError(f"site policy: missing key {missing[0]!r}")
    values = dict(data)
    for key, value in values.items():
        kinds = _TYPES[key]
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise ValueError(f"site policy: {key}={value!r} has the wrong type (expected "
                             f"{' or '.join(k.__name__ for k in kinds)})")
    if values.get("methods") is not None:
        if not all(isinstance(m, str) for m in values["methods"]):
            raise ValueError(f"site policy: methods={values['methods']!r} must be a list of method names")
        values["methods"] = tuple(values["methods"])
    if "face_tasks" in values:
        if not all(isinstance(t, str) for t in values["face_tasks"]):
            raise ValueError(f"site policy: face_tasks={values['face_tasks']!r} must be a list of task names")
        values["face_tasks"] = tuple(values["face_tasks"])
    if "max_input_size" in values:
        values["max_input_size"] = tuple(values["max_input_size"])
    for key in _FLOATS:
        if values.get(key) is not None:
            try:
                values[key] = float(values[key])
            except OverflowError as err:
                raise ValueError(f"site policy: {key} is too large to be a number") from err
    if base is not None:
        for key in ("data_path", "ledger_path", "public_path", "eval_path"):
            if values.get(key):
                path = Path(values[key]).expanduser()
                values[key] = str(path if path.is_absolute() else (base / path).resolve())
    return SitePolicy(**values)


def load_policy(path: str | Path) -> SitePolicy:
    """Read and validate a site policy YAML file (relative paths are relative to its directory)."""
    path = Path(path)
    data = read_yaml(path, what="site policy")
    try:
        return policy_from_dict(data, base=path.resolve().parent)
    except ValueError as err:
        raise ValueError(f"{path}: {str(err).replace('--policy POLICY', f'--policy {path}')}") from err


def policy_to_dict(policy: SitePolicy) -> dict[str, Any]:
    out = dataclasses.asdict(policy)
    if out["chunk_memory"] is None:  # a policy without it means what it did before, fingerprint included
        del out["chunk_memory"]
    out["methods"] = list(policy.allowed_methods)
    out["max_input_size"] = list(policy.max_input_size)
    order = ["policy_version"] + [k for k in out if k != "policy_version"]
    return {k: out[k] for k in order}


def write_policy(path: str | Path, policy: SitePolicy) -> Path:
    """Write a policy YAML atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(policy_to_dict(policy), sort_keys=False))
    tmp.replace(path)
    return path


@functools.lru_cache(maxsize=64)
def _derived_min_sigma(epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    return calibrate_sigma(
        target_epsilon=epsilon, delta=delta, sample_rate=sample_rate, steps=steps, accountant=accountant
    )


def what_the_draws_show(policy: SitePolicy) -> str:
    """What a Feature-DP site's public draws give a server over a whole federation, in plain words (P17)."""
    if policy.public_records is None:
        return DRAWS_SHOW_ALL
    return (f"over a federation the server sees the blurred copy and labels of at most the {policy.public_records} "
            "records of a fixed set the public term draws from (public_records), and from the draws only that this "
            f"site holds at least {policy.public_records} records, not how many this site holds")


def min_sigma_for(policy: SitePolicy) -> float:
    """The smallest noise multiplier this site accepts (P6).

    Explicit ``min_sigma`` wins. Otherwise it is derived by the site itself
    from its own policy only: the sigma at which ``lifetime_rounds`` rounds of
    ``steps_per_round`` steps at its ``sample_rate`` spend exactly its epsilon
    at its delta with its accountant. A server asking for less noise would
    spend the budget in fewer rounds than the site agreed to.
    """
    if policy.min_sigma is not None:
        return float(policy.min_sigma)
    return _derived_min_sigma(
        float(policy.epsilon), float(policy.delta), float(policy.sample_rate),
        policy.lifetime_rounds * policy.steps_per_round, policy.accountant,
    )


def sigma_shortfall(policy: SitePolicy, *, sigma: float) -> str | None:
    """Why ``sigma`` is weaker than this site's minimum, or None when it is acceptable (P6).

    Same rule as ``min_sigma_for`` without calibrating: with no explicit
    ``min_sigma``, sigma is acceptable iff ``lifetime_rounds`` rounds at it
    stay within the site's epsilon (epsilon decreases with sigma, so this is
    exactly "sigma >= derived minimum", at the cost of one accountant call).
    """
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not (sigma > 0 and math.isfinite(sigma)):
        return f"sigma={sigma!r} adds no usable noise"
    if policy.min_sigma is not None:
        if sigma < policy.min_sigma:
            return f"sigma={sigma:.6g} < this site's min_sigma={policy.min_sigma:.6g}"
        return None
    steps = policy.lifetime_rounds * policy.steps_per_round
    planned = StepRecord(sigma=float(sigma), sample_rate=float(policy.sample_rate), steps=steps)
    eps = epsilon_spent([planned], delta=policy.delta, accountant=policy.accountant)
    if eps > policy.epsilon:
        return (f"sigma={sigma:.6g} is below this site's minimum: {policy.lifetime_rounds} rounds x "
                f"{policy.steps_per_round} steps at q={policy.sample_rate:.4g} would cost eps={eps:.4g} > "
                f"{policy.epsilon:g} (delta={policy.delta:g})")
    return None
