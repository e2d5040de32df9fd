"""Experiments built on the library: the privacy-utility study (``study``, ``study_report``), the one-run
privacy audit (``audit``), membership inference (``membership``), reconstruction (``reconstruction``,
``reconstruction_read``) and re-identification in DP-pixelized frames (``reid``).

The library beside this package (``fedpose.shared.model``, ``fedpose.shared.data``, ``fedpose.shared.privacy``,
``fedpose.shared.training.loop``, ``fedpose.shared.training.runs``) never imports from it.
"""
