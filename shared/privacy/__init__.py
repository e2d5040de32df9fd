"""Privacy machinery of fedpose (docs/explanation/design.md: the FP-DP step and the invariants), in three
parts: ``step`` (the private step of Algorithm 1 and what it is built from), ``accounting`` (epsilon
from what ran, ledgers, the printed claim) and ``audit`` (the one-run audit's canaries, hooks and
bound). Import the module you need; nothing is re-exported here so that importing the package stays
cheap.
"""
