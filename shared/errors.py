"""The project's own errors and the exit codes the ``fedpose`` command maps them to.

Every error a user can hit is one line that says what to do; its exit code says what kind of problem it
was, so scripts and service managers can tell them apart (the errors reference lists them).
"""

from enum import IntEnum


class ExitCode(IntEnum):
    """What ``fedpose`` returns."""

    OK = 0
    NOT_OK = 1  # a check ran and found a problem: site status not healthy, ledgers not reconciled, failed cells
    USAGE = 2  # the command line itself is wrong (unknown option, missing argument): argparse's own
    BAD_INPUT = 3  # a file, folder, config value or argument value is wrong or missing; the message names it
    REFUSED = 4  # refused on privacy grounds: a budget, a policy, a missing or replaced ledger
    FAILED = 5  # a run started and failed: training, a federation that did not finish, a run not submitted
    INTERRUPTED = 130  # Ctrl-C


class ConfigError(ValueError):
    """A configuration value is missing, unknown or of the wrong type/range."""


class PrivacyRefusal(ValueError):
    """Refused to protect a guarantee (a budget, a policy, a lost ledger): nothing ran, nothing was spent."""


class NonFinitePublicGradients(ValueError):
    """No finite per-sample gradient of the public samples at the current weights: V and the tensor scales cannot
    be computed there (a training run that reaches this after its first step has diverged)."""
