"""A train job's starting point: another job's artifact (init_from) or torchvision's published weights
(model.weights), loaded into the freshly built model before it moves to its device and before the
optimizer exists. A checkpoint the job resumes from still overwrites them (train_checkpoint.resume).

Everything loads but the classifier head, when the number of classes differs. The head is found, not
listed per architecture: it is the state_dict entries whose shape depends on num_classes (the model
built once more with one class more tells which), and it keeps the fresh init the job's seed drew.
Any other difference, a missing or extra key or a shape that does not depend on num_classes, fails
the job naming it. Nothing is unpickled: safetensors, or torch.load(weights_only=True).
"""
import os
import re
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from pydantic import ValidationError
from torch import nn

from trainyard.app.spec import ModelSpec, TrainJob
from trainyard.worker import artifacts, nets
from trainyard.worker.data import TensorData
from trainyard.worker.errors import JobError
from trainyard.worker.job_context import JobContext

# A download of published weights that stalls this long (to connect, or between reads) fails the job.
DOWNLOAD_TIMEOUT_S = 30
# Published DenseNet files predate `norm.1` becoming `norm1` (torchvision's densenet._load_state_dict).
_DENSENET_OLD_KEY = re.compile(r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|"
                               r"running_var))$")


def apply(model: nn.Module, spec: TrainJob, data: TensorData, ctx: JobContext) -> None:
    """Load the starting point spec names, if any, into model (fresh from nets.build_model, on the CPU);
    ctx.started_from then says where it came from and which layers were re-made."""
    if spec.init_from is not None:
        state, origin = from_job(spec, data.input_shape, ctx.init_dir)
        started: dict[str, Any] = {"init_from": spec.init_from}
    elif spec.model.weights is not None:
        state, weights, path = published(spec.model.arch, spec.model.weights)
        if isinstance(getattr(model, "expand", None), nets.ExpandChannels):  # the gray-image wrapper's keys
            state = {f"net.{k}": v for k, v in state.items()}
        origin = f"torchvision's {weights} ({path})"
        started = {"weights": str(weights), "file": str(path)}
    else:
        return
    remade = load(model, state, origin, lambda: head(spec.model, data.input_shape, len(data.class_names)))
    ctx.started_from = {**started, "remade": sorted(remade)}
    if ctx.world.leader:
        changed = "; ".join(f"{name} re-made for {n} outputs (was {was}), fresh from seed {spec.train.seed}"
                            for name, (was, n) in sorted(remade.items()))
        ctx.log(f"started from {origin}: {changed or 'every layer loaded'}")


def from_job(spec: TrainJob, input_shape: tuple[int, ...], init_dir: Path | None) -> tuple[dict, str]:
    """The weights of the artifact in init_dir, once it is the same architecture on the same input shape."""
    origin = f"init_from job {spec.init_from}'s model"
    if init_dir is None:
        raise JobError(f"init_from: this run was given no artifact of job {spec.init_from}")
    try:
        state, meta = artifacts.load_state(init_dir)
        arch = artifacts.model_spec(meta).arch
    except FileNotFoundError as e:
        raise JobError(f"init_from: the artifact of job {spec.init_from} is gone ({e.filename})") from None
    except (KeyError, ValidationError):
        raise JobError(f"init_from: job {spec.init_from} saved no model trainyard can rebuild") from None
    if arch != spec.model.arch:
        raise JobError(f"init_from: job {spec.init_from} trained a {arch}; this job's model is a {spec.model.arch}")
    if tuple(meta["input_shape"]) != tuple(input_shape):
        raise JobError(f"init_from: job {spec.init_from}'s model takes inputs of shape {tuple(meta['input_shape'])}; "
                       f"{spec.data.dataset} has {tuple(input_shape)}")
    return state, origin


def published(arch: str, name: str) -> tuple[dict[str, torch.Tensor], Any, Path]:
    """torchvision's published weights `name` of arch: (state_dict, the weights enum member, its file). The
    file is where torch.hub caches it (TORCH_HOME), downloaded there first if it is missing."""
    import torchvision

    enum = torchvision.models.get_model_weights(arch)
    try:
        weights = enum.verify(name)
    except KeyError:
        raise JobError(f"model.weights: {arch} has no weights {name!r}; valid: DEFAULT, "
                       f"{', '.join(w.name for w in enum)}") from None
    path = weights_file(weights.url)
    if not path.exists():
        download(weights.url, path)
    state = artifacts.load_checkpoint(path)
    if arch.startswith("densenet"):
        state = {_DENSENET_OLD_KEY.sub(r"\1\2", k): v for k, v in state.items()}
    if arch == "googlenet":  # its auxiliary classifiers, which trainyard builds googlenet without
        state = {k: v for k, v in state.items() if not k.startswith(("aux1.", "aux2."))}
    return state, weights, path


def weights_file(url: str) -> Path:
    """Where torch.hub (and torchvision's weights=...) keeps the file of url."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)


def download(url: str, path: Path) -> None:
    """Fetch url to path as torch.hub does on a cache miss (its hash check included), failing the job
    with what to put where when that cannot be done."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = torch.hub.HASH_REGEX.search(path.name)
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # torch.hub's urlopen has none: an offline host would hang
    try:
        torch.hub.download_url_to_file(url, str(path), digest.group(1) if digest else None, progress=False)
    except Exception as e:
        raise JobError(f"model.weights: {path} is missing and could not be downloaded from {url} "
                       f"({type(e).__name__}: {str(e)[:200]}); place that file at that path (the directory is "
                       f"$TORCH_HOME/hub/checkpoints) on the worker's host, or let the worker reach the URL") from None
    finally:
        socket.setdefaulttimeout(previous)


def load(model: nn.Module, state: dict[str, torch.Tensor], origin: str, find_head) -> dict[str, tuple[int, int]]:
    """Load state into model, all but the head when its shape differs; find_head() -> the head's keys.
    Returns the re-made layers: name -> (outputs in state, outputs here)."""
    own = model.state_dict()  # keeps the modules' version metadata (MNASNet refuses a state without it)
    # Integer buffers (batch norm's step counter, index tables) are missing from older published files;
    # they keep the model's own, as torch's versioned loading does.
    missing = [k for k in own if k not in state and own[k].is_floating_point()]
    extra = [k for k in state if k not in own]
    if missing or extra:
        raise JobError(f"{origin} does not fit this job's model: " + "; ".join(
            f"{what} {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
            for what, keys in (("it lacks", missing), ("it has unknown", extra)) if keys))
    differ = [k for k in own if k in state and state[k].shape != own[k].shape]
    head_keys = find_head() if differ else set()
    for k in differ:
        if k not in head_keys:
            raise JobError(f"{origin} does not fit this job's model: {k} is {list(state[k].shape)} there and "
                           f"{list(own[k].shape)} here (only the classifier head, sized by num_classes, may differ)")
    own.update({k: v for k, v in state.items() if k not in differ})
    model.load_state_dict(own)
    return {k.rsplit(".", 1)[0]: (state[k].shape[0], own[k].shape[0]) for k in differ}


def head(spec: ModelSpec, input_shape: tuple[int, ...], data_classes: int) -> set[str]:
    """The state_dict keys of spec's model whose shape depends on the number of classes: its classifier head."""
    outputs = spec.num_classes or data_classes
    this, wider = (_shapes(spec.model_copy(update={"num_classes": n}), input_shape, data_classes)
                   for n in (outputs, outputs + 1))
    return {k for k, shape in this.items() if wider[k] != shape}


def _shapes(spec: ModelSpec, input_shape: tuple[int, ...], data_classes: int) -> dict[str, torch.Size]:
    with torch.random.fork_rng(devices=[]):  # probes must not move the job's random stream
        try:
            with torch.device("meta"):  # shapes only: nothing allocated, nothing initialised
                probe = nets.build_model(spec, input_shape, data_classes)
        except (NotImplementedError, RuntimeError):  # builders that read values (regnet computes its widths)
            probe = nets.build_model(spec, input_shape, data_classes)
    return {k: v.shape for k, v in probe.state_dict().items()}
