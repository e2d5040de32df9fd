"""Privacy accounting (invariant P5): epsilon from the (sigma, q, steps) history that ran (``accountant``),
the durable SQLite ledgers both sides keep, group privacy and the claim the tool prints (P8).
"""
