"""fedpose: federated, differentially private 2D human pose estimation.

The one import root of the distribution. Its packages are the repository's top-level folders, each linked
from here (``fedpose/server`` is a link to ``../server``): ``fedpose.server`` (the federation's server),
``fedpose.client`` (a hospital site), ``fedpose.edge`` (the camera: export, runtimes, pipeline), ``fedpose.shared``
(what they share: configuration, data, model, the privacy step and its accounting, DP pixelization, training,
metrics, experiments), ``fedpose.cli`` (the ``fedpose`` command) and ``fedpose.configs`` (the shipped YAML
configs). Nothing is imported here: a camera install imports ``fedpose.edge`` without torch or Flower.
"""

__all__ = ["cli", "client", "configs", "edge", "server", "shared"]
