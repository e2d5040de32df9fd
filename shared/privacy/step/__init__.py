"""The private step (FP-DP Algorithm 1): feature maps psi, per-sample gradients and book-keeping
clipping, clipped sums, Poisson sampling, Gaussian noise, the projection subspace and the FP-DP
gradient that puts them together (``fpdp``).
"""
