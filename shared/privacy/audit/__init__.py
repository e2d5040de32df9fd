"""The one-run privacy audit (Steinke, Nasr, Jagielski 2023): canaries, the hooks a private run offers
the audit (never set in production) and the empirical lower bound on epsilon.
"""
