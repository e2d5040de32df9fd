"""Experiments built on the library: the privacy-utility study (``study``, ``study_report``), the one-run
privacy audit (``audit``) and membership inference (``membership``).

The library beside this package (``shared.model``, ``shared.data``, ``shared.privacy``, ``shared.train``,
``shared.runs``) never imports from it.
"""
