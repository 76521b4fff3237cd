"""A job's model as a file that runs without trainyard: ONNX, torch.export's .pt2, or TorchScript.

Owns the torch side of GET /jobs/{id}/artifact?format=onnx|pt2|torchscript. The model is rebuilt
from its artifact (safetensors weights: nothing is unpickled) and wrapped in RawInputs, which does
what a predict job does to its `inputs` rows (reshape, the training data's normalisation, softmax),
so the exported file turns the same raw rows into the same class probabilities. One file is
written atomically. The API (app/jobs/exports.py) runs this module in a subprocess on the CPU,

    python -m trainyard.worker.export ARTIFACT_DIR FORMAT OUT

so that the server itself never imports torch; it exits with NOT_REBUILDABLE when the artifact has
weights but no recipe for the model (a run job's save_model without arch), MISSING_EXTRA without the
`export` extra, 1 on any other failure, the reason on stderr's last line.
"""
import argparse
import json
import math
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainyard.app.core.layout import EXPORT_FILES
from trainyard.app.jobs.exports import MISSING_EXTRA, NOT_REBUILDABLE, why_not_rebuildable
from trainyard.app.spec import TrainJob
from trainyard.worker import artifacts, data, infer

# torch.export would specialise a batch dimension of 0 or 1 to a constant; 2 keeps it symbolic.
EXAMPLE_ROWS = 2
META_NAME = "trainyard.json"


class NotRebuildable(Exception):
    """The artifact holds weights but not what rebuilds the model around them."""


class RawInputs(nn.Module):
    """(N, width) float32 rows of raw values, as a predict job's `inputs` -> (N, classes) probabilities."""

    def __init__(self, model: nn.Module, input_shape: tuple[int, ...], dataset: str | None, pixels: bool | None):
        super().__init__()
        self.model, self.input_shape, self.dataset, self.pixels = model, input_shape, dataset, pixels

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        # The same calls as infer._predict_inputs: data.normalize's branches are plain Python on
        # constants, so the traced graph holds exactly the arithmetic a predict job runs.
        x = data.normalize(self.dataset, rows.reshape(-1, *self.input_shape), self.pixels)
        return F.softmax(self.model(x).float(), dim=1)


def export(artifact_dir: Path, fmt: str, out: Path) -> None:
    """Write artifact_dir's model, wrapped in RawInputs, to out in fmt (a key of EXPORT_FILES)."""
    meta = artifacts.read_meta(artifact_dir)
    reason = why_not_rebuildable(meta)  # the API checks this first; a direct run of this module gets it too
    if reason:
        raise NotRebuildable(reason)
    model, meta = artifacts.load_model(artifact_dir, torch.device("cpu"))
    train_spec = TrainJob.model_validate(meta["spec"]) if "spec" in meta else None
    dataset, pixels = infer.raw_scaling(meta, train_spec)
    input_shape = tuple(meta["input_shape"])
    wrapper = RawInputs(model, input_shape, dataset, pixels).eval()
    example = torch.zeros(EXAMPLE_ROWS, math.prod(input_shape))
    about = {"input": f"float32 (N, {math.prod(input_shape)}): raw values as a predict job's `inputs` rows, "
                      f"each a sample of shape {list(input_shape)} flattened; normalisation is built in",
             "output": "float32 (N, classes): class probabilities", "class_names": infer.output_names(meta),
             "input_shape": list(input_shape), "dataset": dataset}
    with torch.no_grad():
        artifacts._atomic_write(out, lambda tmp: WRITERS[fmt](wrapper, example, tmp, about))


def _batch_dynamic() -> tuple[dict[int, Any]]:
    return ({0: torch.export.Dim("batch")},)


def _onnx(wrapper: nn.Module, example: torch.Tensor, path: Path, about: dict) -> None:
    program = torch.onnx.export(wrapper, (example,), dynamo=True, verbose=False, input_names=["input"],
                                output_names=["probabilities"], dynamic_shapes=_batch_dynamic())
    if program is None:  # only the legacy exporter (dynamo=False) returns none
        raise RuntimeError("torch.onnx.export returned no program")
    program.model.metadata_props[META_NAME] = json.dumps(about)
    # One self-contained file (the weights inline, not beside it), as a download should be.
    program.save(path, external_data=False)


def _pt2(wrapper: nn.Module, example: torch.Tensor, path: Path, about: dict) -> None:
    program = torch.export.export(wrapper, (example,), dynamic_shapes=_batch_dynamic())
    with open(path, "wb") as f:  # a file object: torch.export warns about a path not ending in .pt2
        torch.export.save(program, f, extra_files={META_NAME: json.dumps(about)})


def _torchscript(wrapper: nn.Module, example: torch.Tensor, path: Path, about: dict) -> None:
    with warnings.catch_warnings():
        # Deprecated upstream in favour of torch.export; still the format libtorch (C++) loads directly.
        warnings.simplefilter("ignore", FutureWarning)
        traced = torch.jit.trace(wrapper, example)
        torch.jit.save(traced, str(path), _extra_files={META_NAME: json.dumps(about)})


WRITERS = {"onnx": _onnx, "pt2": _pt2, "torchscript": _torchscript}
assert WRITERS.keys() == EXPORT_FILES.keys()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainyard.worker.export", description=__doc__.split("\n")[0])
    parser.add_argument("artifact_dir", type=Path)
    parser.add_argument("format", choices=sorted(EXPORT_FILES))
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    # The API stops an export nobody waits for with SIGTERM: as SystemExit, the temp file goes with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        export(args.artifact_dir, args.format, args.out)
    except NotRebuildable as e:
        print(e, file=sys.stderr)
        return NOT_REBUILDABLE
    except ImportError as e:
        print(f"exporting to {args.format} needs the `export` extra (pip install 'trainyard[export]'): {e}",
              file=sys.stderr)
        return MISSING_EXTRA
    except Exception as e:  # the reason on one line, for the API's response
        reason = " ".join(str(e).split())[:1000]
        print(f"{type(e).__name__}: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
