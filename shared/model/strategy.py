"""Training strategies (``train.strategy``): which of PoseNet's parameters a strategy trains, and freezing the rest.

Sites, the server and centralized runs all take the trainable names from here, in the model's parameter order.
"""

from __future__ import annotations

from torch import nn

from fedpose.shared.configuration.schema import Strategy, TrainConfig
from fedpose.shared.model.posenet import TASK_SCALE


def fixed_task_weights(train: TrainConfig) -> bool:
    """Whether the run keeps the task-uncertainty weights at their public values (``train.task_weights``; auto:
    under dpsgd and proj, whose clip would otherwise give them much of every record's bound)."""
    if train.task_weights == "auto":
        return train.method in ("dpsgd", "proj")
    return train.task_weights == "public"


def trainable_names(model: nn.Module, strategy: Strategy, *, fixed_tasks: bool = False) -> list[str]:
    """Names of the parameters a strategy trains; ``fixed_tasks``: never the task-uncertainty weights.

    finetune: stages 1-3 (``stages.0-2``) and the patch embedding frozen except
    every LayerNorm; stage 4 (``stages.3``), all LayerNorms and the heads (pose and face) train.
    full / scratch: everything (scratch differs only in not loading weights).
    bitfit: every bias and every LayerNorm (trunk and heads), no weight matrix (DP-BiTFiT, Bu et al. 2022;
    BitFit, Ben Zaken et al. 2021): under DP the noise fills every trained coordinate, so training ~1 % of the
    weights (9 k of 935 k on tinyvit-small) puts ~10 times less noise norm into each step for the same epsilon,
    while the public-pretrained weights keep the features. bitfit-head: bitfit and the heads' weights (87 k).
    full-fixed-tasks: every weight but the task-uncertainty weights.
    lora: the low-rank adapters of the trunk's linear layers (``fedpose.shared.model.lora``: they must be on the
    model) and the heads' weights.
    These four keep the task-uncertainty weights (``head.log_task_scale``) at their public-pretrained values: their
    per-sample gradient, three numbers of the same sign for every sample, has norm ~1 at the public start
    against ~0.3 for all the biases and norms together, so under a clip C it would take most of every record's
    bound and most of the signal the noise is calibrated to.
    """
    names = [n for n, _ in model.named_parameters()]
    if fixed_tasks:
        return [n for n in trainable_names(model, strategy) if n != TASK_SCALE]
    if strategy in ("full", "scratch"):
        return names
    if strategy == "full-fixed-tasks":
        return [n for n in names if n != TASK_SCALE]
    if strategy == "lora":
        adapters = [n for n in names if ".lora." in n]
        if not adapters:
            raise ValueError("train.strategy lora trains low-rank adapters, and this model carries none: adapters "
                             "are added and merged inside one centralized training run (fedpose train, fedpose "
                             "study, fedpose audit); a federation (whole weights) does not run it")
        return [n for n in names if n in adapters or (n.startswith(("head.", "face_head.")) and n != TASK_SCALE)]
    if strategy not in ("finetune", "bitfit", "bitfit-head"):
        raise ValueError(f"unknown strategy {strategy!r}; choose finetune, full, scratch, bitfit, bitfit-head, "
                         "full-fixed-tasks or lora")
    norm_params = {
        f"{mod_name}.{p_name}" if mod_name else p_name
        for mod_name, mod in model.named_modules()
        if isinstance(mod, nn.LayerNorm)
        for p_name, _ in mod.named_parameters(recurse=False)
    }
    if strategy in ("bitfit", "bitfit-head"):
        heads = ("head.", "face_head.") if strategy == "bitfit-head" else ()
        return [n for n in names if n != TASK_SCALE and (n.startswith(heads) or n in norm_params
                                                         or n.rpartition(".")[2] == "bias")]
    return [n for n in names if n.startswith(("stages.3.", "head.", "face_head.")) or n in norm_params]


def apply_strategy(model: nn.Module, strategy: Strategy, *, fixed_tasks: bool = False) -> list[str]:
    """Set ``requires_grad`` per strategy (``fixed_tasks``: ``fixed_task_weights``); returns the trainable names."""
    keep = set(trainable_names(model, strategy, fixed_tasks=fixed_tasks))
    for name, p in model.named_parameters():
        p.requires_grad_(name in keep)
    return [n for n, _ in model.named_parameters() if n in keep]


def apply_train_strategy(model: nn.Module, train: TrainConfig) -> list[str]:
    """``apply_strategy`` as a run's ``train`` section says: its strategy, and the task-uncertainty weights kept at
    their public values where ``fixed_task_weights`` says so; returns the trainable names."""
    return apply_strategy(model, train.strategy, fixed_tasks=fixed_task_weights(train))
