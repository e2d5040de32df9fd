"""The DP pixelization mechanism (Fan, DBSec 2018; region-adaptive variant): spec, grid, frame, mechanism.

Both sides use it: the edge releases pixelized camera frames (``edge/pixelize``, which adds storage,
masks and the printed claim, and explains the noise scale), and training can take a pixelization as
the public feature map psi (``shared/privacy/step/psi_maps.py``, ``privacy.psi: dp-pixelize``).
"""
