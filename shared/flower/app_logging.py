"""Logging for code run inside Flower app processes (ServerApp, ClientApp).

Flower captures only stdout/stderr of an app process and our module loggers
have no handler there: give the named loggers one stderr handler, once.
"""

from __future__ import annotations

import logging
import sys


def setup_app_logging(*names: str, defer_to_root: bool = False) -> None:
    """INFO-level stderr logging for the loggers ``names``.

    ``defer_to_root``: if the root logger already has handlers (the fedpose CLI
    configured logging, as in ``fedpose simulate``), only set the levels.
    Otherwise the loggers get their own handler and stop propagating, since
    flwr adds a root handler later and every line would appear twice.
    """
    # Flower's logger has its own console handler (INFO); a root handler that a library adds on import
    # (opacus calls logging.basicConfig) would print its records again, DEBUG included.
    logging.getLogger("flwr").propagate = False
    if defer_to_root and logging.getLogger().handlers:
        for name in names:
            logging.getLogger(name).setLevel(logging.INFO)
        return
    for name in names:
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
            logger.addHandler(handler)
            logger.propagate = False
        logger.setLevel(logging.INFO)
