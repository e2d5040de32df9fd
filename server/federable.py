"""What a federation refuses in a config: the settings only a centralized run can honour, and those no run can.

Each of them would make every site refuse every request (client/request.py) or has no meaning across sites, so the
server stops before its first round, with nothing sent and nothing spent.
"""

from __future__ import annotations

from fedpose.shared.configuration.methods import raw_psi_conflict
from fedpose.shared.configuration.schema import Config
from fedpose.shared.errors import ConfigError


def refuse_centralized_only(cfg: Config) -> None:
    """Raise ``ConfigError`` for a setting a federation cannot run."""
    if cfg.train.method == "nonprivate":
        raise ConfigError("train.method: a federation trains privately; choose dpsgd, proj, fdp or fpdp")
    if cfg.privacy.noise_factor != 1.0:  # each site plans its own sigma from its policy
        raise ConfigError("privacy.noise_factor: for centralized reference runs only; a federation's sites plan "
                          "their noise from their own budgets")
    if cfg.privacy.noise_multiplier is not None:  # a site's sigma comes from its own budget, never from the server
        raise ConfigError("privacy.noise_multiplier: a diagnostic for centralized runs only; a federation's sites "
                          "plan their noise from their own budgets")
    if cfg.data.basis_split is not None:  # a site computes V from the public set it holds
        raise ConfigError("data.basis_split: for centralized runs only; in a federation each site computes V from "
                          "the public set it holds")
    if cfg.privacy.psi == "dp-pixelize":  # a site's psi is pinned by its policy, which has no eps_pix / m fields
        raise ConfigError("privacy.psi: dp-pixelize is for centralized runs only: in a federation each site would "
                          "have to keep its one release per record across rounds and pin eps_pix and m in its "
                          "policy, which sites cannot do yet; choose blur or pixelate")
    if cfg.train.tensor_scales != "none":  # the sites would refuse every request (client/request.py)
        raise ConfigError("train.tensor_scales: public is for centralized runs only: its scales come from the public "
                          "split at every refresh, which a site does not hold; use train.tensor_scales: none")
    if cfg.train.optimizer == "public-adam":  # the sites would refuse every request (client/request.py)
        raise ConfigError("train.optimizer: public-adam is for centralized runs only: its second moment comes from "
                          "the public split at every step, which a site does not hold; choose adam or sgd")
    if cfg.train.strategy == "lora":  # the sites would refuse every request (client/request.py)
        raise ConfigError("train.strategy: lora is for centralized runs only: its adapters are made and merged inside "
                          "one run, while a federation sends and averages whole weights; choose full or finetune")
    conflict = raw_psi_conflict(cfg.train.images, cfg.train.method, cfg.privacy.unit, cfg.privacy.augment_multiplicity)
    if conflict:  # the sites would refuse every request (client/request.py)
        raise ConfigError(conflict)
