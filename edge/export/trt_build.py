"""Build a TensorRT engine (``.plan``) from an exported ONNX file.

Engines are specific to the GPU, the TensorRT version and (on Jetson) the
JetPack release: build on the device that runs the camera, never copy a
plan between machines. On a Jetson (JetPack 6.1+/TensorRT 10.3):

    sudo apt install python3-libnvinfer          # TensorRT Python bindings from JetPack
    fedpose edge build --onnx model.onnx --out model.plan --precision fp16

The equivalent ``trtexec`` lines (``/usr/src/tensorrt/bin/trtexec`` on Jetson;
``trtexec_command`` prints the exact one for a file):

    # TensorRT 10.x, fixed batch, FP16 by builder flag
    trtexec --onnx=model.onnx --saveEngine=model.plan --fp16 --memPoolSize=workspace:1024M
    # dynamic batch: an optimization profile
    trtexec --onnx=model.onnx --saveEngine=model.plan --fp16 --memPoolSize=workspace:1024M \\
        --minShapes=image:1x3x128x96 --optShapes=image:4x3x128x96 --maxShapes=image:8x3x128x96
    # INT8 from a Q/DQ model (fedpose edge export --int8): explicit quantization, no calibrator
    trtexec --onnx=model.int8.onnx --saveEngine=model.plan --int8 --fp16
    # TensorRT 11.x: strongly typed; precision comes from the ONNX (FP16 file or Q/DQ file)
    trtexec --onnx=model.fp16.onnx --saveEngine=model.plan --stronglyTyped

TensorRT versions:
- 10.x (JetPack 6.1/6.2, x86 10.x wheels) and 8.6 (JetPack 6.0): weakly typed
  network; FP16 via ``BuilderFlag.FP16``; INT8 via ``BuilderFlag.INT8`` on a
  Q/DQ graph (plus FP16 for the layers left unquantized). 8.6 still needs
  the EXPLICIT_BATCH creation flag.
- 11.x: only strongly typed networks (``NetworkDefinitionCreationFlag.
  STRONGLY_TYPED``): FP16 needs an FP16 ONNX (``export --fp16``), INT8 a
  Q/DQ ONNX; the builder precision flags are gone.

``tensorrt`` is imported inside ``build_engine`` only; everything that
validates the request (``check_build_request``, ``trtexec_command``) works
without it, and without the ``onnx`` package (``fedpose.edge.export.onnx_proto`` reads
the file): the build runs in the camera's slim install.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

Precision = Literal["fp32", "fp16", "int8"]
PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "int8")
DEFAULT_PROFILE = (1, 1, 4)
TRT_INSTALL_HINT = (
    "TensorRT is not installed: pip install 'fedpose[tensorrt]' on an NVIDIA machine; "
    "on Jetson use JetPack's python3-libnvinfer (sudo apt install python3-libnvinfer)"
)


def import_tensorrt() -> Any:
    """``import tensorrt`` with the install hint on failure."""
    try:
        import tensorrt as trt
    except ImportError as err:
        raise ImportError(TRT_INSTALL_HINT) from err
    return trt


@dataclass(frozen=True)
class OnnxInfo:
    """What the builder needs to know about an ONNX file before TensorRT sees it."""

    path: Path
    input_name: str
    batch: int | None  # None: dynamic batch
    input_size: tuple[int, int]
    fp16: bool
    qdq: bool


@dataclass(frozen=True)
class BuildRequest:
    """A validated build: precision, workspace and the batch profile (min, opt, max) for dynamic inputs."""

    onnx: OnnxInfo
    out: Path
    precision: Precision
    workspace_mb: int
    profile: tuple[int, int, int] | None


def parse_profile(value: str) -> tuple[int, int, int]:
    """``"min,opt,max"`` (or one number N meaning N,N,N) -> (min, opt, max)."""
    try:
        parts = [int(v) for v in str(value).split(",")]
    except ValueError as err:
        raise ValueError(f"--batch must be min,opt,max (e.g. 1,4,8), got {value!r}") from err
    if len(parts) == 1:
        parts = parts * 3
    if len(parts) != 3 or not 1 <= parts[0] <= parts[1] <= parts[2]:
        raise ValueError(f"--batch must be three integers 1 <= min <= opt <= max, got {value!r}")
    return parts[0], parts[1], parts[2]


def read_onnx_info(onnx_path: str | Path) -> OnnxInfo:
    """Input name, batch, (H, W), FP16 and Q/DQ presence of an exported model.

    Read with ``fedpose.edge.export.onnx_proto`` (the protobuf wire format, no ``onnx`` package): the engine is
    built in the camera's slim install, which has no train extra (docs/how-to/jetson.md).
    """
    from fedpose.edge.export.onnx_proto import FLOAT16, ProtoError, read_graph

    path = Path(onnx_path)
    if not path.is_file():
        raise FileNotFoundError(f"ONNX file {path} does not exist")
    try:
        graph = read_graph(path.read_bytes())
    except ProtoError as err:
        raise ValueError(f"{path} is not a readable ONNX file: {err}") from err
    inputs = graph.inputs
    if len(inputs) != 1:
        raise ValueError(f"{path}: expected one image input, found {[i.name for i in inputs]}")
    dims = list(inputs[0].dims)
    if len(dims) != 4 or dims[1] != 3 or dims[2] is None or dims[3] is None:
        raise ValueError(f"{path}: input shape {dims} is not (N, 3, H, W) with fixed H, W")
    return OnnxInfo(
        path=path,
        input_name=inputs[0].name,
        batch=dims[0],
        input_size=(int(dims[2]), int(dims[3])),
        fp16=inputs[0].elem_type == FLOAT16,
        qdq=bool(graph.op_types & {"QuantizeLinear", "DequantizeLinear"}),
    )


def check_build_request(
    onnx_path: str | Path,
    out: str | Path,
    *,
    precision: str = "fp16",
    workspace_mb: int = 1024,
    batch: tuple[int, int, int] | None = None,
    trt_major: int = 10,
) -> BuildRequest:
    """Validate a build before touching TensorRT (so mistakes fail fast, even on this CPU box)."""
    info = read_onnx_info(onnx_path)
    out = Path(out)
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {PRECISIONS}, got {precision!r}")
    if out.suffix not in (".plan", ".engine"):
        raise ValueError(f"engine file {out} must end in .plan or .engine")
    if workspace_mb < 16:
        raise ValueError(f"--workspace must be at least 16 MB, got {workspace_mb}")
    if precision == "int8" and not info.qdq:
        raise ValueError(
            f"{info.path} has no QuantizeLinear/DequantizeLinear nodes: INT8 engines are built from a Q/DQ model; "
            "export one with `fedpose edge export --int8` and build from that file"
        )
    if trt_major >= 11 and precision == "fp16" and not info.fp16:
        raise ValueError(
            f"TensorRT {trt_major} builds strongly typed networks: FP16 comes from the ONNX, and {info.path} is FP32; "
            "export with `fedpose edge export --fp16`"
        )
    profile = None
    if info.batch is None:
        profile = batch or DEFAULT_PROFILE
    elif batch is not None and batch != (info.batch,) * 3:
        raise ValueError(
            f"{info.path} has a fixed batch of {info.batch}; --batch {','.join(map(str, batch))} needs an export "
            "with --batch dynamic"
        )
    return BuildRequest(onnx=info, out=out, precision=precision, workspace_mb=int(workspace_mb), profile=profile)


def trtexec_command(request: BuildRequest, *, trt_major: int = 10) -> str:
    """The ``trtexec`` line that builds the same engine (for docs and for devices without Python bindings)."""
    parts = ["trtexec", f"--onnx={request.onnx.path}", f"--saveEngine={request.out}"]
    if trt_major >= 11:
        parts.append("--stronglyTyped")
    elif request.precision == "fp16":
        parts.append("--fp16")
    elif request.precision == "int8":
        parts += ["--int8", "--fp16"]
    parts.append(f"--memPoolSize=workspace:{request.workspace_mb}M")
    if request.profile is not None:
        h, w = request.onnx.input_size
        name = request.onnx.input_name
        for flag, n in zip(("min", "opt", "max"), request.profile):
            parts.append(f"--{flag}Shapes={name}:{n}x3x{h}x{w}")
    return " ".join(parts)


def build_engine(
    onnx_path: str | Path,
    out: str | Path,
    *,
    precision: str = "fp16",
    workspace_mb: int = 1024,
    batch: tuple[int, int, int] | None = None,
) -> Path:
    """Parse the ONNX with TensorRT's OnnxParser, build and write a serialized engine (atomically)."""
    request = check_build_request(onnx_path, out, precision=precision, workspace_mb=workspace_mb, batch=batch)
    trt = import_tensorrt()
    major = int(str(trt.__version__).split(".")[0])
    if major >= 11:  # re-check with the real version (strong typing)
        request = check_build_request(
            onnx_path, out, precision=precision, workspace_mb=workspace_mb, batch=batch, trt_major=major
        )
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    if major >= 11:
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    elif major >= 10:
        flags = 0  # explicit batch is the only mode in 10.x
    else:
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(request.onnx.path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ValueError(f"TensorRT {trt.__version__} cannot parse {request.onnx.path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, request.workspace_mb << 20)
    if major < 11:
        if request.precision in ("fp16", "int8"):
            if not getattr(builder, "platform_has_fast_fp16", True):  # deprecated in 10.x
                log.warning("this GPU has no fast FP16; the engine will mostly run FP32 kernels")
            config.set_flag(trt.BuilderFlag.FP16)
        if request.precision == "int8":
            config.set_flag(trt.BuilderFlag.INT8)  # explicit quantization: scales come from the Q/DQ nodes
    if request.profile is not None:
        profile = builder.create_optimization_profile()
        h, w = request.onnx.input_size
        lo, opt, hi = ((n, 3, h, w) for n in request.profile)
        profile.set_shape(request.onnx.input_name, lo, opt, hi)
        config.add_optimization_profile(profile)
    log.info("building TensorRT %s engine from %s (%s, workspace %d MB, profile %s): this takes minutes",
             trt.__version__, request.onnx.path, request.precision, request.workspace_mb, request.profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {request.onnx.path} (see the log above)")
    request.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = request.out.with_suffix(request.out.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(memoryview(serialized))
    tmp.replace(request.out)
    log.info("wrote %s (%d bytes)", request.out, request.out.stat().st_size)
    return request.out
