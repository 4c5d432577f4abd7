"""The ONNX file of an exported level, checked in ONNX Runtime the way a device runs it.

* :func:`onnx_bytes`: the level's ``torch.export`` program (or the model) as one self-contained
  ONNX file (weights inside, input ``input`` NCHW float32, output ``logits``, batch dimension
  ``batch``), through PyTorch's exporter (packages ``onnx`` and ``onnxscript``);
* :func:`check_onnx`: that file in ONNX Runtime on the CPU, **one image at a time** (a batch of
  one, as a device runs it), against the PyTorch model's logits for the same images: every logit
  within :data:`TOLERANCE`, else :class:`OnnxCheckFailed` (the export writes nothing);
* :func:`ort_snippet`: the model card's example, a raw image file to a class name with ONNX
  Runtime, numpy and Pillow, using the card's preprocessing.

The tolerance, ``abs(ORT - PyTorch) <= 1e-4 + 1e-4 * abs(PyTorch)`` per logit: both sides compute in
float32 (epsilon 1.2e-7) with different kernels (ONNX Runtime's MLAS against PyTorch's), so the
logits differ by reordered sums: about 1e-7 relative per layer for the small CNN (measured: 4e-7
at logits below 1), growing with depth and the length of the sums. 1e-4 leaves three orders of
magnitude for that and still catches a wrong operator, layout or weight, each of which moves
logits by far more. Predictions must then agree: a prediction can only differ where the PyTorch
model's two top logits lie within the tolerance of each other (a tie at float32 precision), and
the check reports how many did.
"""

from __future__ import annotations

import json
import warnings
from importlib.util import find_spec
from typing import Any, cast

import numpy as np
import torch
from torch import nn

#: the packages writing (``onnx``, ``onnxscript``) and checking (``onnxruntime``) the ONNX file
ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
ATOL = 1e-4
RTOL = 1e-4
TOLERANCE = f"abs(ORT - PyTorch) <= {ATOL:g} + {RTOL:g} * abs(PyTorch) for every logit"
INPUT, OUTPUT, BATCH = "input", "logits", "batch"


class OnnxCheckFailed(RuntimeError):
    """ONNX Runtime's outputs differ from the PyTorch model's beyond :data:`TOLERANCE`."""


def missing_packages() -> list[str]:
    """Which of :data:`ONNX_PACKAGES` this installation lacks (``make setup`` installs them all)."""
    return [name for name in ONNX_PACKAGES if find_spec(name) is None]


def onnx_bytes(source: nn.Module | torch.export.ExportedProgram, example: torch.Tensor) -> bytes:
    """``source`` (an exported program with a dynamic batch, or the model) as ONNX file bytes."""
    dynamic = (
        None if isinstance(source, torch.export.ExportedProgram) else ({0: torch.export.Dim(BATCH, min=1, max=4096)},)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            source,
            (example,),
            None,
            input_names=[INPUT],
            output_names=[OUTPUT],
            dynamic_shapes=dynamic,
            external_data=False,
            verbose=False,
        )
    proto = cast("torch.onnx.ONNXProgram", program).model_proto  # the dynamo exporter (the default) returns one
    # the program names its batch dimension s<N>: call it `batch` in the file's signature
    first = proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param
    if first:
        for value in (*proto.graph.input, *proto.graph.output, *proto.graph.value_info):
            for dim in value.type.tensor_type.shape.dim:
                if dim.dim_param == first:
                    dim.dim_param = BATCH
    return bytes(proto.SerializeToString())


def check_onnx(
    data: bytes,
    images: torch.Tensor,
    reference: torch.Tensor,
    labels: torch.Tensor | None = None,
    what: str = "the run's test set",
) -> dict[str, Any]:
    """Run the ONNX file in ONNX Runtime (CPU, one thread) on ``images`` one at a time and compare
    with ``reference`` (the PyTorch model's logits for them): the figures for the card, or
    :class:`OnnxCheckFailed` when a logit lies beyond :data:`TOLERANCE` (or is not finite)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1  # a device's one image, no thread pool
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    x = np.ascontiguousarray(images.detach().cpu().numpy(), dtype=np.float32)
    out = np.concatenate([session.run([OUTPUT], {INPUT: x[i : i + 1]})[0] for i in range(len(x))])
    ref = reference.detach().cpu().numpy().astype(np.float32)
    diff = np.abs(out.astype(np.float64) - ref)
    bad = ~(diff <= ATOL + RTOL * np.abs(ref))  # NaN counts as beyond
    agree = out.argmax(1) == ref.argmax(1)
    figures = {
        "runtime": f"onnxruntime {ort.__version__}, CPUExecutionProvider, one thread",
        "batch_size": 1,
        "data": what,
        "examples": len(x),
        "tolerance": TOLERANCE,
        "atol": ATOL,
        "rtol": RTOL,
        "max_abs_logit_difference": float(np.nan_to_num(diff, nan=np.inf).max()) if diff.size else 0.0,
        "predictions_agreeing": int(agree.sum()),
        "accuracy": None if labels is None else int((out.argmax(1) == labels.cpu().numpy()).sum()) / max(1, len(x)),
    }
    if bad.any():
        rows = np.flatnonzero(bad.any(1))
        raise OnnxCheckFailed(
            f"model.onnx refused: ONNX Runtime's logits (one image at a time) differ from the PyTorch model's beyond "
            f"{TOLERANCE} on {len(rows)} of {len(x)} images of {what} (first: image {int(rows[0])}; max difference "
            f"{figures['max_abs_logit_difference']:.3g}); predictions agree on {figures['predictions_agreeing']} of "
            f"{len(x)}. Nothing was written."
        )
    return figures


def ort_snippet(pre: dict[str, Any], model_file: str = "model.onnx", image_file: str = "image.png") -> str:
    """Python that classifies one image file with ONNX Runtime, preprocessing as the card says."""
    mode = "L" if int(pre["channels"]) == 1 else "RGB"
    names = pre.get("class_names")
    lines = [
        "import numpy as np",
        "import onnxruntime as ort",
        "from PIL import Image, ImageOps",
        "",
        f"SIZE, MEAN, STD = {int(pre['image_size'])}, {json.dumps(list(pre['mean']))}, {json.dumps(list(pre['std']))}",
    ]
    if names:
        lines.append(f"CLASSES = {json.dumps(list(names))}")
    lines += [
        "",
        f'image = Image.open("{image_file}").convert("{mode}")',
        "image = ImageOps.fit(image, (SIZE, SIZE), Image.Resampling.BILINEAR)  # scale to cover, centre-crop",
        "x = np.asarray(image, dtype=np.float32).reshape(SIZE, SIZE, -1) / 255",
        "x = (x - np.array(MEAN, np.float32)) / np.array(STD, np.float32)",
        "x = np.ascontiguousarray(x.transpose(2, 0, 1)[None])  # NCHW float32, a batch of one image",
        f'session = ort.InferenceSession("{model_file}", providers=["CPUExecutionProvider"])',
        f'logits = session.run(["{OUTPUT}"], {{"{INPUT}": x}})[0][0]',
        "prediction = int(logits.argmax())",
        "print(CLASSES[prediction])" if names else "print(prediction)",
    ]
    return "\n".join(lines)
