"""Experiments built on the library: the privacy-utility study (``study``, ``study_report``), the one-run
privacy audit (``audit``) and membership inference (``membership``).

The library beside this package (``fedpose.shared.model``, ``fedpose.shared.data``, ``fedpose.shared.privacy``,
``fedpose.shared.training.loop``, ``fedpose.shared.training.runs``) never imports from it.
"""
