"""Privacy accounting (invariant P5): epsilon from the (sigma, q, steps) history that ran (``accountant``),
the durable SQLite history of spend both sides' ledgers keep (``history``), group privacy (``group``) and the
claim the tool prints (``claims``, P8).
"""
