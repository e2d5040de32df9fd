"""What a run is told: the frozen, typed configuration (``schema``), built from YAML (``yaml_io``, ``build``),
flattened for Flower's run config (``flat``), and the training methods with what each implies (``methods``).
"""
