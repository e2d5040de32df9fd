"""Typed, frozen run configuration loaded from YAML and validated at the boundary.

Every section is a frozen dataclass; ``load_config`` rejects unknown keys and wrong types naming the dotted key
path (``train.lr: expected float, got str``). Flower's run config holds flat scalars: ``flatten``/``unflatten``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from fedpose.shared.configuration.build import build_dataclass
from fedpose.shared.configuration.flat import flatten, flatten_plain, to_dict, unflatten
from fedpose.shared.data.face import FACE_TASKS, valid_face_tasks
from fedpose.shared.data.synth.ward import WardSpec
from fedpose.shared.errors import ConfigError
from fedpose.shared.configuration.yaml_io import dump_yaml, read_yaml
from fedpose.shared.configuration.methods import Method, Unit

Strategy = Literal["finetune", "full", "scratch", "bitfit", "bitfit-head", "full-fixed-tasks", "lora"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)


# Upper bounds on sizes read from configs (and checkpoints), checked before anything is allocated.
MAX_INPUT_SIDE = 2048  # px per side of the model input (the paper uses 256 x 192)
MAX_HIDDEN = 4096  # width of the SimCC head's hidden layer
MAX_JOINT_CHANNELS = 1024
MAX_FACE_ATTRIBUTES = 64
MAX_MULTIPLICITY = 64  # augmented copies of one record per step (privacy.augment_multiplicity)


@dataclass(frozen=True)
class DataConfig:
    """Where the MPII-layout splits live and how images are cropped."""

    # synthetic: the embedded ward of data.synth, generated at root when root is absent (and checked when present);
    # files: the splits already at root (MPII json layout, e.g. converted with fedpose data convert); a missing
    # root is an error. No default: a config says which, so a mistyped path is never filled with synthetic data.
    source: Literal["synthetic", "files"] | None = None
    root: str = "runs/data/ward"
    # files: what to download and where to put it, printed with the error when root or a split is missing.
    help: str = ""
    synth: WardSpec = field(default_factory=WardSpec)  # the embedded synthetic ward (data.source: synthetic)
    # Private training splits (pooled for a centralized run; one per site in a federation).
    train_splits: tuple[str, ...] = ("site-0", "site-1", "site-2")
    public_split: str = "public"
    val_split: str = "val"
    # The public split V and the public scales are computed from, augmented as the private records are: images
    # held out from pretraining (the synthetic ward's "basis" split, data.synth.basis images), so that V is not
    # built from the very images the start was fitted to. null: the public split, unaugmented (centralized runs;
    # a site computes V from the public set it holds).
    basis_split: str | None = None
    input_size: tuple[int, int] = (64, 48)  # (H, W)
    augment: bool = True

    def __post_init__(self) -> None:
        if len(self.input_size) != 2 or min(self.input_size) < 32 or max(self.input_size) > MAX_INPUT_SIDE:
            raise ConfigError(f"data.input_size: expected [H, W] with both in [32, {MAX_INPUT_SIDE}], "
                              f"got {list(self.input_size)}")
        if not self.train_splits:
            raise ConfigError("data.train_splits: name at least one private split")
        repeated = sorted({s for s in self.train_splits if self.train_splits.count(s) > 1})
        if repeated:
            raise ConfigError(f"data.train_splits: {repeated[0]!r} is listed twice; every private record would be "
                              "trained on as two records and the per-record privacy claim would not hold")
        if self.val_split == self.public_split or self.val_split in self.train_splits:
            raise ConfigError(f"data.val_split {self.val_split!r} is also the public split or a private training "
                              "split: validate on held-out data")
        if self.basis_split is not None and self.basis_split in (*self.train_splits, self.val_split, self.public_split):
            raise ConfigError(f"data.basis_split {self.basis_split!r} is also a private, validation or pretraining "
                              "split: V's public images are held out from all of them")
        if self.public_split in self.train_splits:
            raise ConfigError(f"data.public_split {self.public_split!r} is also a private training split: "
                              "public and private data must be disjoint (P2)")


@dataclass(frozen=True)
class ModelConfig:
    variant: Literal["tinyvit-small", "tinyvit-5m"] = "tinyvit-small"
    split_ratio: float = 2.0
    # Standard deviation of the SimCC Gaussian labels, in bins, for (x, y).
    sigma: tuple[float, float] = (2.0, 2.0)
    joint_channels: int = 16
    hidden: int = 128
    task_uncertainty: bool = True
    vis_weight: float = 0.1  # used only when task_uncertainty is off
    # DPLH's face tasks as extra heads on the same trunk (docs/explanation/face-tasks.md); empty: body pose only.
    face_tasks: tuple[str, ...] = ()
    face_attributes: int = 4  # classes of the attribute head (the ward's face cue: plain, glasses, beard, mask)

    def __post_init__(self) -> None:
        if not valid_face_tasks(self.face_tasks):
            raise ConfigError(f"model.face_tasks: choose distinct tasks from {list(FACE_TASKS)}, got "
                              f"{list(self.face_tasks)}")
        if not 2 <= self.face_attributes <= MAX_FACE_ATTRIBUTES:
            raise ConfigError(f"model.face_attributes: must be in [2, {MAX_FACE_ATTRIBUTES}], got "
                              f"{self.face_attributes}")
        if self.split_ratio <= 0:
            raise ConfigError(f"model.split_ratio: must be > 0, got {self.split_ratio}")
        if len(self.sigma) != 2 or min(self.sigma) <= 0:
            raise ConfigError(f"model.sigma: expected two positive numbers, got {list(self.sigma)}")
        if not 1 <= self.joint_channels <= MAX_JOINT_CHANNELS:
            raise ConfigError(f"model.joint_channels: must be in [1, {MAX_JOINT_CHANNELS}], got {self.joint_channels}")
        if not 1 <= self.hidden <= MAX_HIDDEN:
            raise ConfigError(f"model.hidden: must be in [1, {MAX_HIDDEN}], got {self.hidden}")
        if self.split_ratio > 16:
            raise ConfigError(f"model.split_ratio: must be <= 16, got {self.split_ratio}")
        if self.vis_weight < 0:
            raise ConfigError(f"model.vis_weight: must be >= 0, got {self.vis_weight}")


@dataclass(frozen=True)
class PretrainConfig:
    """Non-private training on the public split only (the starting point for finetune/full)."""

    out: str = "runs/pretrained"
    epochs: int = 30
    batch_size: int = 32
    lr: float = 2e-3
    weight_decay: float = 1e-4
    seed: int = 0
    # A TinyViT checkpoint (timm or original layout, e.g. ImageNet tiny_vit_5m_22k_distill.pth) the trunk starts
    # from before public pretraining; null: random initialisation.
    init: str | None = None
    # Photometric jitter of the public images (shared/data/augment.Augment.photometric): the public split has
    # one camera style, the sites others. Without it the start (the pretrained model on the sites' style) moves
    # with the seed and the CPU's kernels by several PCKh points (29.7 to 43.5 over three seeds here); at 0.5 by
    # about half a point (docs/results: how reproducible a start is).
    photometric: float = 0.5
    # CPU threads of public pretraining, whatever runtime.threads says: a CPU sums a matmul's blocks in another
    # order with another count, so the weights depend on it, and every run of a folder must find one start.
    threads: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or not 1 <= self.threads <= 256:
            raise ConfigError(f"pretrain.threads: must be an int in [1, 256], got {self.threads!r}")
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ConfigError("pretrain.epochs and pretrain.batch_size must be >= 1 and pretrain.lr > 0")
        if not 0 <= self.photometric < 1:
            raise ConfigError(f"pretrain.photometric: must be in [0, 1), got {self.photometric}")
        if self.weight_decay < 0:
            raise ConfigError(f"pretrain.weight_decay: must be >= 0, got {self.weight_decay}")


@dataclass(frozen=True)
class PrivacyConfig:
    epsilon: float = 0.8
    delta: float = 1e-5
    clip_norm: float = 1.0
    accountant: Literal["rdp", "prv"] = "rdp"
    psi: Literal["blur", "pixelate", "dp-pixelize"] = "blur"
    # blur: sigma as a fraction of min(H, W); pixelate, dp-pixelize: block size in input px.
    psi_param: float = 0.03
    # dp-pixelize only (centralized runs): psi(x) is a DP pixelization of each record's canonical crop, released
    # once per record: eps_pix-DP for changes of up to psi_m pixels (shared/pixelization's mechanism, 3 channels).
    psi_eps: float = 1.0
    psi_m: int = 1
    k: int = 50  # projection rank: V's directions (fewer, with a warning, when the public gradients span fewer)
    m: int = 100  # public samples for the basis
    basis_every: int = 10  # recompute V every this many steps (centralized) / rounds (federated)
    # V from the public per-sample gradients each clipped to this norm, as the private step clips each record's
    # (null: as they are), so that a few samples whose gradients dwarf the rest cannot take V's directions.
    basis_clip: float | None = None
    # When basis_clip is null: clipped, every public row clipped to privacy.clip_norm, as the private step clips a
    # record's (a few runaway rows, 1e11 times the median, took V down to one direction); raw: as they are.
    basis_rows: Literal["clipped", "raw"] = "clipped"
    chunk_size: int = 16  # per-sample gradients computed this many at a time (memory bound)
    # A share of the device's free memory, in (0, 1), that the private step's chunks may hold: the step then runs
    # the most rows at a time whose measured peak fits it, at most chunk_size (the cap), chosen once before the
    # first step from a blank chunk of the model (a GPU fills better with larger chunks). null: chunk_size rows.
    # A site sizes its chunks by its own policy's chunk_memory, and refuses a request that asks for more.
    chunk_memory: float | None = None
    # The privacy unit: record (neighbouring datasets differ in one image) or patient (in all images of one
    # person; needs patient ids: the ward's identities.json or a patients.json sidecar). At patient level
    # train.batch_size is the expected number of PATIENTS per step (q_p = B / patients).
    unit: Unit = "record"
    # The most records of one patient that training uses. patient: each patient's clipped contribution is the
    # mean gradient of at most this many of their records (a fixed subset, the rest left out). record: the data
    # must hold no more per patient (checked where patient ids exist) and the claim states the group-privacy
    # bound at this many records. null: all records (patient) / no cap stated (record).
    max_records_per_patient: int | None = None
    # Centralized research runs only: the planned noise multiplier times this (>= 1). The epsilon reported is the
    # accountant's for the sigma that ran, so it is below privacy.epsilon. The study's federated reference uses it:
    # a pooled run with the noise a federation's average carries (about sqrt(sites) times a pooled run's).
    noise_factor: float = 1.0
    # Centralized diagnostics only: the noise multiplier that runs, instead of the one calibrated to the budget
    # (null). 0: clipped without noise, the ceiling of a clipped recipe, whose epsilon the accountant reports as
    # unbounded (infinity); a federation and every site refuse it. Any other value: a fixed sigma (e.g. a small
    # batch's at the sigma / B of a large one), its epsilon computed from it as always.
    noise_multiplier: float | None = None
    # Augmentation multiplicity (De et al. 2022): each sampled record is augmented this many times and its
    # contribution is clip(mean of the K augmented copies' gradients, C): still one clipped term per record, so
    # the accountant's epsilon does not depend on it; a step costs K times the per-sample gradients. 1: off.
    # Record level only (a patient's records are already averaged before clipping).
    augment_multiplicity: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.augment_multiplicity, bool) or not 1 <= self.augment_multiplicity <= MAX_MULTIPLICITY:
            raise ConfigError(f"privacy.augment_multiplicity: must be an int in [1, {MAX_MULTIPLICITY}], got "
                              f"{self.augment_multiplicity!r}")
        if self.augment_multiplicity > 1 and self.unit != "record":
            raise ConfigError("privacy.augment_multiplicity: > 1 is for privacy.unit: record (at patient level "
                              "each patient's records are already averaged before clipping)")
        if self.epsilon <= 0:
            raise ConfigError(f"privacy.epsilon: must be > 0, got {self.epsilon}; pick a positive budget")
        if not 0 < self.delta < 1:
            raise ConfigError(f"privacy.delta: must be in (0, 1), got {self.delta}")
        if self.clip_norm <= 0:
            raise ConfigError(f"privacy.clip_norm: must be > 0, got {self.clip_norm}")
        if self.k < 1 or self.m < 1:
            raise ConfigError("privacy.k and privacy.m must be >= 1")
        if self.k > self.m:
            raise ConfigError(f"privacy.k = {self.k} > privacy.m = {self.m}: the basis has at most m directions; "
                              "lower k or raise m")
        if self.psi_param <= 0:
            raise ConfigError(f"privacy.psi_param: must be > 0, got {self.psi_param}")
        if self.basis_clip is not None and not (math.isfinite(self.basis_clip) and self.basis_clip > 0):
            raise ConfigError(f"privacy.basis_clip: must be a finite number > 0 or null, got {self.basis_clip}")
        if self.basis_every < 1 or self.chunk_size < 1:
            raise ConfigError("privacy.basis_every and privacy.chunk_size must be >= 1")
        if self.chunk_memory is not None and not (math.isfinite(self.chunk_memory) and 0 < self.chunk_memory < 1):
            raise ConfigError(f"privacy.chunk_memory: must be a share of the free memory in (0, 1) or null, got "
                              f"{self.chunk_memory}")
        if self.psi == "dp-pixelize" and (self.psi_param != int(self.psi_param) or self.psi_param < 2):
            raise ConfigError(f"privacy.psi_param: dp-pixelize takes a cell side in whole pixels >= 2, got "
                              f"{self.psi_param:g}")
        if not (math.isfinite(self.psi_eps) and self.psi_eps > 0):
            raise ConfigError(f"privacy.psi_eps: must be a finite number > 0, got {self.psi_eps}")
        if self.psi_m < 1:
            raise ConfigError(f"privacy.psi_m: must be >= 1 (pixels that may differ), got {self.psi_m}")
        if not (math.isfinite(self.noise_factor) and self.noise_factor >= 1):
            raise ConfigError(f"privacy.noise_factor: must be a finite number >= 1 (it only adds noise), got "
                              f"{self.noise_factor}")
        if self.noise_multiplier is not None and not (math.isfinite(self.noise_multiplier)
                                                      and self.noise_multiplier >= 0):
            raise ConfigError(f"privacy.noise_multiplier: must be a finite number >= 0 or null, got "
                              f"{self.noise_multiplier}")
        if self.max_records_per_patient is not None and self.max_records_per_patient < 1:
            raise ConfigError(f"privacy.max_records_per_patient: must be >= 1 or null, got "
                              f"{self.max_records_per_patient}")


@dataclass(frozen=True)
class TrainConfig:
    method: Method = "fpdp"
    # What trains: full (every weight), scratch (every weight, from random ones), finetune (stage 4, every
    # LayerNorm, the heads), bitfit (every bias and LayerNorm, no weight matrix: 1 % of tinyvit-small, so the DP
    # noise fills 100 times fewer coordinates), bitfit-head (bitfit and the heads' weights), full-fixed-tasks (every
    # weight but the task-uncertainty weights, kept at their public values), lora (low-rank adapters on the trunk's
    # linear layers, and the heads; merged into the weights when the run ends; centralized runs only).
    strategy: Strategy = "full"
    # The task-uncertainty weights (head.log_task_scale): train, public (kept at their public-pretrained values), or
    # auto: public under dpsgd and proj, trained otherwise. Under a clip their per-sample gradient (three numbers of
    # one sign for every record) takes much of each record's bound, and over a long DP run they ran away (the
    # visibility log-scale to -11, e^22 on one loss term, against -1.7 to -5.1 without DP).
    task_weights: Literal["auto", "train", "public"] = "auto"
    lora_rank: int = 8  # lora: the rank r of each adapter U D (U: out x r, D: r x in); ignored otherwise
    epochs: int = 30
    # Expected private batch size B = q * n (Poisson sampling with q = B / n).
    batch_size: int = 64
    public_batch_size: int = 32
    # tensor-adam: Adam with one second moment per tensor; dp-tensor-adam: each tensor's step also scaled by its
    # signal share under the DP noise (shared/training/tensor_adam.py); public-adam: Adam whose second moment is
    # the public split's gradient at the current weights (shared/training/public_adam.py; centralized runs only)
    optimizer: Literal["sgd", "adam", "tensor-adam", "dp-tensor-adam", "public-adam"] = "adam"
    # public-adam: no coordinate's step is divided by less than this fraction of the RMS over all coordinates of
    # the public second moment's square root (bounds the noise of coordinates with little public gradient)
    adam_floor: float = 0.0
    # public: every tensor's gradient scaled, per sample before clipping, to the same RMS on public data
    # (shared/privacy/step/subspace.py); coordinate: every coordinate's, a diagonal preconditioner from the public
    # per-sample gradients (AdaDPS); both refreshed with V, need the public split, so centralized runs only;
    # none: as it is
    tensor_scales: Literal["none", "public", "coordinate"] = "none"
    lr: float = 1e-3
    # cosine: lr decays from train.lr to 0 over the whole run (all rounds of a federation); constant: no decay.
    schedule: Literal["constant", "cosine"] = "cosine"
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int | None = None  # None: noise from OS entropy (production); an int: reproducible, not for production
    device: Literal["auto", "cpu", "cuda"] = "auto"
    out: str = "runs/train"
    # raw: the images; psi: the non-private baseline "psi(x) only" (psi of each record's canonical crop, what the
    # public term of fdp / fpdp sees); raw+psi: a record's image and that psi, clipped as one (dpsgd, proj).
    images: Literal["raw", "psi", "raw+psi"] = "raw"
    # Exponential moving average of the trained weights (De et al. 2022): after every step
    # w_ema <- ema w_ema + (1 - ema) w, and the run ends with w_ema in the model (centralized: over the whole run;
    # a site: over its round's local steps). Post-processing of the DP updates: no privacy cost. 0: off.
    ema: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.ema < 1:
            raise ConfigError(f"train.ema: must be in [0, 1) (0: off), got {self.ema}")
        if self.images == "psi" and self.method != "nonprivate":  # raw+psi's methods: checked by the run
            raise ConfigError(f"train.images: 'psi' is the non-private psi(x)-only baseline; train.method is "
                              f"{self.method!r} (fdp / fpdp already add the psi(x) gradient)")
        if min(self.epochs, self.batch_size, self.public_batch_size, self.lora_rank) < 1:
            raise ConfigError("train.epochs, batch_size, public_batch_size and lora_rank must be >= 1")
        if self.lr <= 0:
            raise ConfigError(f"train.lr: must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"train.momentum: must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ConfigError(f"train.weight_decay: must be >= 0, got {self.weight_decay}")
        if not 0 <= self.adam_floor < 1:
            raise ConfigError(f"train.adam_floor: must be in [0, 1), got {self.adam_floor}")


@dataclass(frozen=True)
class FederationConfig:
    """The federated run: rounds, local work per round, participation, basis transport."""

    rounds: int = 10
    local_steps: int = 10  # private optimizer steps per site per round
    min_sites: int = 2  # a round needs at least this many valid replies, else it is not aggregated
    # site: each site computes V from the public set it holds at the received global weights (default:
    # V is p x k, 25x the trainable weights in fp16, so broadcasting it cannot meet the downlink target);
    # broadcast: the server computes V and sends it (fp16) every privacy.basis_every rounds.
    basis_mode: Literal["broadcast", "site"] = "site"
    basis_dtype: Literal["float32", "float16"] = "float16"
    round_timeout: float = 900.0  # seconds to wait for replies before going on without a site
    # How site updates are combined (all post-processing of DP updates): mean (uniform over sites: no
    # site's weight comes from a number it reports), coordinate-wise median, or trimmed-mean (drops the
    # largest and smallest value of every coordinate; needs >= 3 sites).
    aggregator: Literal["mean", "median", "trimmed-mean"] = "mean"
    # Before combining, every site's update (site weights - global weights) is scaled to at most the round's
    # lower-median update norm (median), so no one site, however hostile, moves the model by more than an
    # honest site's step; none: no bound (a single site can then plant any weights in the average).
    update_bound: Literal["median", "none"] = "median"
    # Replies whose update has a larger L2 norm are rejected, never averaged (their spend still counts);
    # null: no hard limit (the median bound above still applies).
    max_update_norm: float | None = None
    # keep: each site keeps its local optimizer state (Adam moments) across rounds, on its own disk next to
    # its ledger (post-processing of its own DP outputs; never sent); fresh: a new optimizer every round.
    site_optimizer: Literal["keep", "fresh"] = "fresh"
    # Server step on the averaged update d = fedavg - w: none (w <- fedavg), momentum (FedAvgM), adam (FedAdam).
    server_optimizer: Literal["none", "momentum", "adam"] = "none"
    server_lr: float = 1.0
    server_momentum: float = 0.9
    out: str = "runs/federation"

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.local_steps < 1 or self.min_sites < 1:
            raise ConfigError("federation.rounds, federation.local_steps and federation.min_sites must be >= 1")
        if self.max_update_norm is not None and not (0 < self.max_update_norm < float("inf")):
            raise ConfigError(f"federation.max_update_norm: must be a positive number or null, got "
                              f"{self.max_update_norm}")
        if self.server_lr <= 0:
            raise ConfigError(f"federation.server_lr: must be > 0, got {self.server_lr}")
        if not 0 <= self.server_momentum < 1:
            raise ConfigError(f"federation.server_momentum: must be in [0, 1), got {self.server_momentum}")
        if self.round_timeout <= 0:
            raise ConfigError(f"federation.round_timeout: must be > 0, got {self.round_timeout}")


@dataclass(frozen=True)
class RuntimeConfig:
    """How a run uses the machine: not what it computes, though the numbers depend on it."""

    # Intra-op CPU threads of training, pretraining and evaluation. Fixed, because a CPU matmul sums in another
    # order with another thread count: the same seed then gives the same numbers on every machine.
    threads: int = 2
    # The same for each simulated site (one process per site; they share the machine's cores).
    site_threads: int = 1
    # Ask torch for deterministic kernels (CPU: no effect on speed; CUDA: cuBLAS workspace pinned).
    deterministic: bool = True

    def __post_init__(self) -> None:
        if self.threads < 1 or self.site_threads < 1:
            raise ConfigError("runtime.threads and runtime.site_threads must be >= 1")


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


def section_from_dict(cls: Any, data: dict[str, Any], path: str) -> Any:
    """Build and validate one config section (e.g. a checkpoint's ``ModelConfig``), naming ``path``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping, got {type(data).__name__}")
    return build_dataclass(cls, data, path)


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a Config from nested plain data (as parsed from YAML)."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping at top level, got {type(data).__name__}")
    return build_dataclass(Config, data)


def shipped_configs() -> list[str]:
    """Names of the configs installed with fedpose (``configs/<name>.yaml``)."""
    from importlib import resources

    return sorted(p.name[:-5] for p in resources.files("fedpose.configs").iterdir() if p.name.endswith(".yaml"))


def config_path(name: str | Path) -> Path:
    """A config file: a path to a YAML file, or the name of one shipped with fedpose (``default``, ``paper``)."""
    from importlib import resources

    path, text = Path(name).expanduser(), str(name)
    by_name = "/" not in text and not text.endswith((".yaml", ".yml"))
    shipped = resources.files("fedpose.configs") / f"{text}.yaml" if by_name else None
    if path.is_file() or (shipped is not None and shipped.is_file()):
        return path if path.is_file() else Path(str(shipped))
    missing = f"no config file {text!r} and no shipped config of that name" if by_name else \
        f"config file {path} does not exist (or name a shipped config)"
    raise ConfigError(f"{missing} (shipped: {', '.join(shipped_configs())})")


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """Load a YAML config (a file, or a shipped config by name), apply dotted-key overrides, validate everything."""
    path = config_path(path)
    data = read_yaml(path, what="config file")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping at top level, got {type(data).__name__}")
    if overrides:
        data = unflatten({**flatten_plain(data), **overrides})
    return config_from_dict(data)


def replace(cfg: Config, **dotted: Any) -> Config:
    """Return a copy of ``cfg`` with dotted keys replaced, re-validated (``replace(cfg, **{"train.lr": 0.1})``)."""
    return config_from_dict(unflatten({**flatten(cfg), **dotted}))


def dump_config(cfg: Config, path: str | Path) -> None:
    dump_yaml(to_dict(cfg), path)
