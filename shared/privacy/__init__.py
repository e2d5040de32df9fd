"""Privacy machinery of fedpose (docs/explanation/design.md: the FP-DP step and the invariants).

Modules: ``persample`` (per-sample gradients, clipped sums), ``noise``
(entropy-seeded generators, Gaussian noise), ``sampling`` (Poisson batches),
``subspace`` (projection basis V, flatten order), ``psi`` (feature maps for
Feature-DP), ``fpdp`` (the FP-DP gradient of Algorithm 1), ``accountant``
(Opacus RDP/PRV wrappers, sigma calibration) and ``claims`` (the honest
claim text). Import the module you need; nothing is re-exported here so that
importing the package stays cheap.
"""
