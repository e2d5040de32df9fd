"""The on-camera pipeline: frames in, keypoints (and optionally DP-pixelized frames) out.

    FrameSource (OpenCV, reconnects) -> BoxTracker (ROI, then previous keypoints)
      -> preprocess -> runtime.infer -> postprocess -> keypoints.jsonl
      [-> DP pixelization of the frame, body mask from the keypoints -> pixelized/*.npz]
      [-> annotated video: skeleton over the raw frame; with pixelization the
          pixelized frame alone, or with ``overlay`` the skeleton drawn over it]

Frames never leave the device: what is written is keypoints, and, with
``pixelize``, only the DP-pixelized release (the raw frame is never saved
then, not even in the annotated video). keypoints.jsonl and any overlay are
computed from the raw frames and are not covered by the pixelization
guarantee: ``release_claim`` names every output a run wrote (DESIGN 4b).

The person box follows rtmlib's PoseTracker idea without a detector: the
configured ROI (e.g. the bed) on the first frame, afterwards the padded box
around the previous frame's confident keypoints, smoothed; when too few
keypoints are confident the tracker falls back to the ROI (or the full frame).

Robustness: end of a file ends the run; a live source (camera index,
rtsp/http URL) that stops delivering is reopened with exponential backoff,
a bounded number of times; frames that cannot be decoded are counted and
skipped. A source that cannot be opened at all raises ``SourceError``.

The package: source (``FrameSource``, reconnects), tracking (``BoxTracker``, ROI), options
(``PipelineOptions``, ``PipelineReport``, ``--pixelize`` parsing), outputs (records, drawing, pixelized
frames, ``release_claim``), loop (``run_pipeline``, ``process_frame``), demo_video (a synthetic ward clip with
its ground truth, a source to try the pipeline on without a camera), accuracy (a run scored against that truth),
files (DP pixelization of an image, a folder or a video, and a frame restored from its NPZ: ``edge pixelize``,
``edge restore``).
"""
