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
