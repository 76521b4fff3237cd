"""What every part of the spec shares: the strict base model, the built-in datasets, and the checks on names,
uploads, plugin parameters and how deep free-form JSON nests."""
import json
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from trainyard.app.core import text
from trainyard.app.core.plugins import NAME as PLUGIN_NAME

# Built-in datasets: what a client can discover through GET /catalog, and the pixel scaling the
# worker applies: (mean, std) of pixels scaled to 0..1, as transforms.Normalize does (one per
# channel alike). Adding a dataset is an entry here and a loader in worker/data.py.
DATASET_INFO: dict[str, dict[str, Any]] = {
    "iris": {"source": "shipped", "input_shape": [4], "classes": 3, "samples": 150,
             "split": "val_fraction/split_seed (as sklearn's train_test_split)"},
    "digits": {"source": "shipped", "input_shape": [1, 8, 8], "classes": 10, "samples": 1797,
               "split": "val_fraction/split_seed", "scale": "0..16 -> 0..1"},
    "mnist": {"source": "torchvision (downloaded into the data dir)", "input_shape": [1, 28, 28], "classes": 10,
              "samples": 70000, "split": "official train / test", "pixel_norm": [0.1307, 0.3081]},
    "fashion_mnist": {"source": "torchvision (downloaded into the data dir)", "input_shape": [1, 28, 28],
                      "classes": 10, "samples": 70000, "split": "official train / test",
                      "pixel_norm": [0.2860, 0.3530]},
    "cifar10": {"source": "torchvision (downloaded into the data dir)", "input_shape": [3, 32, 32], "classes": 10,
                "samples": 60000, "split": "official train / test", "pixel_norm": [0.5, 0.5]},
    "fake": {"source": "torchvision FakeData", "input_shape": "data.image_size", "classes": "data.num_classes",
             "samples": "data.size", "split": "val_fraction/split_seed", "pixel_norm": [0.5, 0.5],
             "params": ["image_size", "num_classes", "size"]},
}
DATASETS = tuple(DATASET_INFO)
UPLOAD_PREFIX = "upload:"
_UPLOAD_ID = re.compile(r"[a-z0-9]{1,64}")
# A plugin's parameters, or a run job's config: JSON of at most this many bytes.
MAX_PARAMS_BYTES = 64 << 10
# Free-form JSON a client sends (a run job's config, a plugin's params, a sweep's choice values) nests at
# most this deep: deeper values overflow the recursion of the serialisers downstream (a 500 at ~300).
MAX_JSON_DEPTH = 32


def _no_control_chars(v: str) -> str:
    if found := text.first_control(v):  # a terminal would act on it (ESC ] 52 sets the clipboard)
        raise ValueError(f"{found}: a name is shown on terminals, which act on control characters")
    return v


# A job's or a sweep's name, a sweep's parameter path: shown by the CLI and the dashboard.
ShownName = Annotated[str, Field(max_length=200), AfterValidator(_no_control_chars)]


class _Strict(BaseModel):
    # Unknown fields are refused rather than silently ignored: a typo like "epoch" must not
    # quietly train with the default. NaN and infinities are refused everywhere. Strict types:
    # "5" is not an integer and true is not a number (an integer is still a valid float).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


def check_dataset(name: str) -> str:
    """A built-in dataset, an upload, or a name a plugin may have (whether one does is checked at submit)."""
    if name in DATASETS or PLUGIN_NAME.fullmatch(name):
        return name
    if check_upload(name):
        return name
    raise ValueError(f"unknown dataset {name!r}; valid: {', '.join(DATASETS)}, upload:<id> or a dataset plugin")


def uploads_named(spec: Any) -> set[str]:
    """The ids of the uploads a stored spec names as a dataset, wherever it names one."""
    if isinstance(spec, dict):
        found = {spec["dataset"][len(UPLOAD_PREFIX):]} if isinstance(spec.get("dataset"), str) and \
            check_upload(spec["dataset"]) else set()
        return found.union(*(uploads_named(v) for v in spec.values()))
    if isinstance(spec, list):
        return set().union(*(uploads_named(v) for v in spec))
    return set()


def check_upload(name: str) -> bool:
    return name.startswith(UPLOAD_PREFIX) and bool(_UPLOAD_ID.fullmatch(name[len(UPLOAD_PREFIX):]))


def is_plugin_dataset(name: str) -> bool:
    return name not in DATASETS and not name.startswith(UPLOAD_PREFIX)


def json_depth(value: Any) -> int:
    """How deep lists and objects nest in a JSON value (a scalar: 0, [1]: 1), without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                return deepest  # deep enough to refuse: no need to walk the rest
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def check_depth(value: Any) -> Any:
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"nests lists or objects more than {MAX_JSON_DEPTH} deep")
    return value


def _bounded_params(v: dict | None) -> dict | None:
    if v is not None and len(json.dumps(check_depth(v))) > MAX_PARAMS_BYTES:
        raise ValueError(f"is over {MAX_PARAMS_BYTES // 1024} KiB of JSON")
    return v


Params = Annotated[dict[str, Any] | None, Field(None, description="a plugin's keyword arguments (JSON, at most 64 KiB, "
                                                                "nested at most 32 deep)")]
