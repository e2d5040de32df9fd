"""The configs shipped with fedpose, loadable by name: ``--config default`` is configs/default.yaml."""
