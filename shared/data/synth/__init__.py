"""Synthetic ward: procedural people in hospital-like rooms, written in the MPII json layout.

No pose dataset can be downloaded here, so the default runs on this one
(docs/explanation/design.md: embedded data). What it has to provide, and how:

- Plausible articulated people: a small 3-d kinematic model (hip/knee/
  shoulder/elbow angles, torso bend, lean and twist, body yaw) posed within
  anatomical ranges for six kinds (``POSE_KINDS``), projected
  orthographically and drawn with anti-aliased OpenCV primitives in depth
  order. Joints follow ``fedpose.shared.data.joints`` and MPII's annotation habits
  (thorax on the shoulder line, upper neck a tenth of the way to the crown).
- Non-IID sites: each ``SiteStyle`` fixes wall/floor palette, furniture,
  camera height (person size, vertical foreshortening), lighting, sensor
  noise, camera blur and the mix of poses (an ICU has people in bed, a
  rehab gym has people walking). ``PUBLIC_STYLE`` is a generic, more varied
  look for the public split.
- Identity cues for privacy attacks: skin tone, hair colour and style, face
  pattern (glasses, beard, mask), clothing colours/patterns, wristband and
  sock colours, build. Each person appears in ``images_per_identity`` images;
  ``identities.json`` names the person of every record.
- Fine detail that blur destroys: limbs 1-3 px wide at 128 px, 1-2 px
  bright markers at wrists, ankles, elbows and knees, thin-line clutter
  (IV poles, cables, bars) and small bright dots in a background of similar
  colours. Once blurred, limbs melt into the clutter and markers vanish, so
  training on psi(x) alone localizes worse than on raw pixels.
- Determinism: every random draw comes from an rng derived from (seed, split,
  purpose, index) by hashing, so image i of a split does not depend on any
  other image or split and the same spec gives byte-identical files.

Images are BGR uint8 (OpenCV order) throughout. Coordinates in memory are
0-based pixels; on disk they follow the MPII json convention (1-based,
scale = box / 1.25 / 200, see ``fedpose.shared.data.mpii``), written by the inverse
of the reader's conversion so a round trip returns the same numbers.

The package, one module per concept (each imports only those before it):
body (pose kinds, joint indices, proportions), rng (hashed per-image generators), styles
(``SiteStyle``, presets, ``PUBLIC_STYLE``), identity, pose (kinematic model, placement), draw
(primitives), background, person, face (the face labels of what person draws), render (a whole frame), ward
(spec, samples, files on disk).
"""

from fedpose.shared.data.synth.background import render_background
from fedpose.shared.data.synth.body import (
    CHIN_FRACTION,
    HEAD_TOP,
    L_ANKLE,
    L_ELBOW,
    L_HIP,
    L_KNEE,
    L_SHOULDER,
    L_WRIST,
    NECK,
    NECK_FRACTION,
    PELVIS,
    POSE_KINDS,
    R_ANKLE,
    R_ELBOW,
    R_HIP,
    R_KNEE,
    R_SHOULDER,
    R_WRIST,
    THORAX,
)
from fedpose.shared.data.synth.identity import FACES, HAIR_STYLES, SHIRT_PATTERNS, Identity, make_identity
from fedpose.shared.data.synth.person import head_box, head_geometry, render_person
from fedpose.shared.data.synth.pose import place_pose, sample_pose, sample_pose_3d
from fedpose.shared.data.synth.render import person_box, render_frame
from fedpose.shared.data.synth.rng import _derive_rng  # noqa: F401  (tests check determinism through it)
from fedpose.shared.data.synth.styles import FLOOR_PATTERNS, FURNITURE, PUBLIC_STYLE, Colour, SiteStyle, site_style
from fedpose.shared.data.synth.ward import (
    FORMAT,
    FORMAT_VERSION,
    RENDER_VERSION,
    WardSpec,
    ensure_faces,
    ensure_ward,
    face_sample,
    generate_ward,
    identity_of,
    load_identities,
    manifest_for,
    render_sample,
)

__all__ = [
    "POSE_KINDS",
    "R_ANKLE",
    "R_KNEE",
    "R_HIP",
    "L_HIP",
    "L_KNEE",
    "L_ANKLE",
    "PELVIS",
    "THORAX",
    "NECK",
    "HEAD_TOP",
    "R_WRIST",
    "R_ELBOW",
    "R_SHOULDER",
    "L_SHOULDER",
    "L_ELBOW",
    "L_WRIST",
    "NECK_FRACTION",
    "CHIN_FRACTION",
    "FURNITURE",
    "FLOOR_PATTERNS",
    "Colour",
    "SiteStyle",
    "PUBLIC_STYLE",
    "site_style",
    "HAIR_STYLES",
    "SHIRT_PATTERNS",
    "FACES",
    "Identity",
    "make_identity",
    "sample_pose_3d",
    "sample_pose",
    "place_pose",
    "render_background",
    "head_geometry",
    "head_box",
    "render_person",
    "render_frame",
    "person_box",
    "FORMAT",
    "FORMAT_VERSION",
    "RENDER_VERSION",
    "WardSpec",
    "identity_of",
    "render_sample",
    "manifest_for",
    "generate_ward",
    "ensure_ward",
    "ensure_faces",
    "face_sample",
    "load_identities",
]
