"""Differentially private pixelization (DESIGN P9): Fan's mechanism, region adaptive.

Both sides use it: the edge releases pixelized camera frames (``edge pixelize``, ``edge run --pixelize``),
and training can take a pixelization as the public feature map psi (``shared/privacy/step/psi.py``,
``privacy.psi: dp-pixelize``). Numpy only (OpenCV, lazily, for masks): a camera imports it without torch.

Fan's DP pixelization (L. Fan, "Image pixelization with differential
privacy", DBSec 2018) releases, for a grid of b x b cells, the mean of each
cell plus Laplace noise of scale 255 m / (b^2 eps), clipped to [0, 255].
Two images are *m-neighbours* when they differ in at most m pixels (by any
amount); changing one pixel moves one cell mean by at most 255 / b^2, so the
vector of all means has L1 sensitivity 255 m / b^2 and the release is eps-DP.

This package implements the parallel, region-adaptive variant that the
project follows:

- Algorithm 2 (uniform grid): mirror-pad to a multiple of b, take grid
  means, add noise, clip, crop back to the frame size.
- Algorithm 3 (region adaptive): cells that touch the complex region (the
  body; a cell is complex when the mask covers ANY of its real pixels) are
  split into n x n subcells of side s = b / n; the other cells keep side b.
  Each released mean of a cell of side s gets noise of scale
  255 m / (s^2 eps). Why the frame is still eps-DP: in SUM units every cell
  gets the same scale 255 m / eps (mean = sum / s^2), and the L1 sensitivity
  of the vector of all cell sums is 255 m whatever the cell sizes, because
  each pixel lies in exactly one released cell. A complex cell's coarse mean
  is never released (that would count its pixels twice).

Extensions needed for an honest guarantee, beyond the paper's formula:

- Mirror padding duplicates real pixels into the padding band, so one real
  pixel can enter up to 2 (one axis padded) or 4 (corner) cell sums. A cell
  whose pixels include copies of pixels with multiplicity k gets its noise
  scaled by k (``K`` below, computed per cell as the largest multiplicity of
  any pixel it contains). For a frame whose size is a multiple of b, K = 1
  everywhere, i.e. exactly the paper's scale. Border cells of other frames
  get 2x (or 4x in the corner) noise.
- C channels: one pixel changes C values, so the noise is scaled by C
  (equivalently eps / C per channel, sequential composition). Grayscale
  (C = 1) is the paper's setting.

So the scale of a released mean is 255 * m * C * K / (s^2 * eps).

Noise (``PixelizeSpec.noise``):

- ``"discrete"`` (default): two-sided geometric ("discrete Laplace") noise
  added to the INTEGER cell sums, P(z) proportional to alpha^|z| with
  alpha = exp(-eps / (255 m C K)), then divided by the cell area. The
  released value is an integer divided by the (public) area, so the set of
  possible outputs does not depend on the image. Textbook floating-point
  Laplace noise does not have this property: its low-order bits leak the
  input and can break DP completely (Mironov, "On significance of the least
  significant bits for differential privacy", CCS 2012). The geometric draws
  come from numpy's sampler, whose probabilities are exact only up to
  floating-point rounding of the log; for a certified sampler use the exact
  discrete Laplace of Canonne, Kamath and Steinke (NeurIPS 2020).
- ``"laplace"``: continuous Laplace on the means, as in the paper (subject
  to the floating-point caveat above).

Noise draw order (fixed, so that reference implementations can reproduce
it from the same generator): first the simple cells, shape (Ns, C), in
row-major cell order; then the subcells of complex cells, shape
(Nc, n, n, C), complex cells in row-major order. Laplace draws one standard
Laplace array per level; discrete draws two geometric arrays per level
(noise = first - second).

Modules: spec (``PixelizeSpec``, input bounds), mechanism (``pixelize``: padding, multiplicity, block
sums, noise), frame (``PixelizedFrame``, the release), storage (NPZ save/load/restore), masks (complex
region from keypoints or a file) and claim (what the tool prints).
"""
