"""The body model's fixed parts: pose kinds, joint indices (see ``fedpose.shared.data.joints``) and
proportions in units of standing height."""

from __future__ import annotations

POSE_KINDS: tuple[str, ...] = ("standing", "walking", "sitting", "lying", "bending", "arms_raised")

# Joint indices (see shared.data.joints).
R_ANKLE, R_KNEE, R_HIP, L_HIP, L_KNEE, L_ANKLE, PELVIS, THORAX, NECK, HEAD_TOP = range(10)
R_WRIST, R_ELBOW, R_SHOULDER, L_SHOULDER, L_ELBOW, L_WRIST = range(10, 16)

# Body proportions in units of standing height (ankle to crown ~ 1).
_DIMS = {
    "hip_half": 0.085, "hip_drop": 0.02, "thigh": 0.245, "shin": 0.25, "spine": 0.30,
    "shoulder_half": 0.115, "shoulder_drop": 0.012, "upper_arm": 0.18, "forearm": 0.15, "head": 0.185,
}
NECK_FRACTION = 0.1  # upper neck: this fraction of the way from thorax to head top (MPII habit)
CHIN_FRACTION = 0.33  # the head ellipse spans chin .. crown along thorax -> head top
