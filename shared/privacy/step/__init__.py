"""The private step (FP-DP Algorithm 1), one concept per module, each importing only those listed before it:
``persample`` (per-sample gradients, the checks of a step's inputs and the bound on every contribution, P14),
``layer_rules`` (book-keeping's rule for each layer type), ``bookkeeping`` (every per-sample norm and gradient
from one forward and one backward), ``subspace`` (the projection basis V and the per-tensor scales, from public
data) and ``fpdp`` (the step's spec, its checks, the clipped sums and the FP-DP gradient that puts them
together); ``psi`` (the feature maps), ``noise`` and ``sampling`` import none of them.
"""
