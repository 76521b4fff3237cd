"""Artifacts and checkpoints on disk: atomic writes, and loads that never unpickle arbitrary objects.

An artifact is a directory holding model.safetensors, model.pt (the same CPU state_dict, for
torch.load users) and meta.json (the arguments that rebuild the model, nanoGPT style). A
checkpoint is one torch.save'd dict of tensors and plain Python values, read back with
weights_only=True.
"""
import json
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from trainyard.app.core.layout import ARTIFACT_FILES
from trainyard.app.spec import ModelSpec
from trainyard.worker import nets

ARTIFACT_FORMAT = 1
SAFETENSORS_FILE, TORCH_FILE, META_FILE = (ARTIFACT_FILES[k] for k in ("safetensors", "pt", "meta"))


def _atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """write(tmp) to a temp file beside path, fsync it, then os.replace it over path.

    Readers see the old file or the new one, never half of one, even if the job is killed mid-write.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_torch_save(path: Path, obj: Any) -> None:
    _atomic_write(path, lambda tmp: torch.save(obj, tmp))


def save_json(path: Path, obj: Any) -> None:
    """Atomically write obj as compact JSON, streamed to the file (a result can be tens of MB)."""
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, separators=(",", ":"), allow_nan=False)
    _atomic_write(path, write)


def unwrap(model: nn.Module) -> nn.Module:
    """The module under torch.compile's wrapper, so state_dict keys carry no _orig_mod. prefix."""
    return getattr(model, "_orig_mod", model)


def cpu_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    # clone() because safetensors refuses tensors that share storage, and on the cpu
    # .cpu()/.contiguous() would hand back the live parameters themselves.
    return {k: v.detach().cpu().contiguous().clone() for k, v in unwrap(model).state_dict().items()}


def save_artifact(dir: Path, model: nn.Module | dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Write model.safetensors, model.pt and meta.json into dir, each atomically. meta holds what
    rebuilds the model: `model` (arch and its fields), input_shape, num_classes, class_names."""
    dir.mkdir(parents=True, exist_ok=True)
    state = cpu_state_dict(model) if isinstance(model, nn.Module) else \
        {k: v.detach().cpu().contiguous().clone() for k, v in model.items()}
    meta = {**meta, "format": ARTIFACT_FORMAT}
    _atomic_write(dir / SAFETENSORS_FILE, lambda tmp: safetensors.torch.save_file(state, str(tmp)))
    _atomic_write(dir / TORCH_FILE, lambda tmp: torch.save(state, tmp))
    # meta.json last: its presence says the weights beside it are complete.
    _atomic_write(dir / META_FILE, lambda tmp: tmp.write_text(json.dumps(meta, indent=2)))


def read_meta(dir: Path) -> dict[str, Any]:
    meta = json.loads((dir / META_FILE).read_text())
    if meta.get("format") != ARTIFACT_FORMAT:
        raise ValueError(f"{dir / META_FILE}: unsupported artifact format {meta.get('format')!r}")
    return meta


def load_state(dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An artifact's CPU state_dict (from its safetensors file) and its meta.json."""
    meta = read_meta(dir)
    return safetensors.torch.load_file(str(dir / SAFETENSORS_FILE), device="cpu"), meta


def model_spec(meta: dict[str, Any]) -> ModelSpec:
    # Artifacts of train jobs before meta carried `model` hold it inside the job's spec.
    return ModelSpec.model_validate(meta["model"] if "model" in meta else meta["spec"]["model"])


def load_model(dir: Path, device: torch.device) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the model from meta.json and load its safetensors weights onto device, in eval mode."""
    state, meta = load_state(dir)
    model = nets.build_model(model_spec(meta), tuple(meta["input_shape"]), meta["num_classes"])
    load_weights(model, state)
    return model.to(device).eval(), meta


def load_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """model.load_state_dict(state), strict, for a state read from safetensors or copied tensor by tensor:
    such a state has lost the modules' version metadata, without which some modules (torchvision's
    MNASNet) refuse to load; the model's own, which built these very modules, stands in."""
    if getattr(state, "_metadata", None) is None:
        state = OrderedDict(state)
        state._metadata = model.state_dict()._metadata  # type: ignore[attr-defined]
    model.load_state_dict(state)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Atomically torch.save a checkpoint dict (tensors and plain Python values only)."""
    atomic_torch_save(path, state)


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    # weights_only=True refuses any pickled object that is not a tensor or a plain container.
    return torch.load(path, map_location=map_location, weights_only=True)


def optimizer_to(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move the optimizer's state tensors to device, in place.

    `step` counters stay where they are unless the group is capturable or fused: PyTorch keeps
    them as CPU scalars on purpose (optimizer.load_state_dict does the same).
    """
    for group in optimizer.param_groups:
        on_device_step = bool(group.get("capturable")) or bool(group.get("fused"))
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if key == "step" and not on_device_step:
                    continue
                state[key] = value.to(device)
