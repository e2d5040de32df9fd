"""The 16 MPII joints: names, order, flip pairs, skeleton and PCKh groups.

Every module (synthetic generator, readers, metrics, edge drawing) takes the
joint order from here so that index 9 means head top everywhere.
"""

from __future__ import annotations

JOINT_NAMES: tuple[str, ...] = (
    "r_ankle",  # 0
    "r_knee",  # 1
    "r_hip",  # 2
    "l_hip",  # 3
    "l_knee",  # 4
    "l_ankle",  # 5
    "pelvis",  # 6
    "thorax",  # 7
    "upper_neck",  # 8
    "head_top",  # 9
    "r_wrist",  # 10
    "r_elbow",  # 11
    "r_shoulder",  # 12
    "l_shoulder",  # 13
    "l_elbow",  # 14
    "l_wrist",  # 15
)
NUM_JOINTS = len(JOINT_NAMES)

# Left/right pairs swapped by a horizontal flip.
FLIP_PAIRS: tuple[tuple[int, int], ...] = ((0, 5), (1, 4), (2, 3), (10, 15), (11, 14), (12, 13))

# Bones for drawing people and skeletons (parent, child).
SKELETON: tuple[tuple[int, int], ...] = (
    (0, 1), (1, 2), (2, 6), (6, 3), (3, 4), (4, 5),
    (6, 7), (7, 8), (8, 9),
    (10, 11), (11, 12), (12, 7), (7, 13), (13, 14), (14, 15),
)

# Paper / mmpose PCKh columns: name -> joint indices averaged for the column.
PCKH_GROUPS: dict[str, tuple[int, ...]] = {
    "head": (9,),
    "shoulder": (12, 13),
    "elbow": (11, 14),
    "wrist": (10, 15),
    "hip": (2, 3),
    "knee": (1, 4),
    "ankle": (0, 5),
}
# Joints left out of the PCKh mean (as mmpose's MPII metric: pelvis, thorax).
PCKH_EXCLUDED: tuple[int, ...] = (6, 7)


def flip_permutation() -> list[int]:
    """Index permutation that maps joint i to its mirror joint after a horizontal flip."""
    perm = list(range(NUM_JOINTS))
    for a, b in FLIP_PAIRS:
        perm[a], perm[b] = b, a
    return perm
