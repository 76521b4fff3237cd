"""GET /catalog: everything a client may put in a job, derived from the spec's models and names."""
from trainyard.app.core import device_names
from trainyard.app.spec.common import DATASET_INFO
from trainyard.app.spec.jobs import PredictJob, RunJob, TrainJob
from trainyard.app.spec.train import ACTIVATIONS, ARCH_FIELDS, ARCHS, TORCHVISION_ARCHS

ARCH_INPUTS = {"mlp": "any (flattened)", "cnn": "images (C, H, W)", "cifar_net": "images (C, 32, 32)"}


def catalog(plugins: list[dict] | None = None) -> dict:
    """Everything a client may put in a job, with the limits, derived from the job models; plugins:
    those installed on this server or on live workers (kind, name, distribution, version, where)."""
    archs = [{"name": name, "params": [*ARCH_FIELDS[name], "num_classes"], "inputs": ARCH_INPUTS[name]}
             for name in ARCHS]
    archs += [{"name": name, "source": "torchvision.models", "params": ["num_classes", "weights"],
               "inputs": "images (C, H, W); 1-channel images are expanded to 3"} for name in TORCHVISION_ARCHS]
    return {
        "architectures": archs,
        "datasets": [{"name": name, **info} for name, info in DATASET_INFO.items()]
        + [{"name": "upload:<id>", "source": "POST /datasets"}],
        "activations": list(ACTIVATIONS),
        "devices": list(device_names.JOB_DEVICES),
        "plugins": plugins or [],
        "schemas": {"train": TrainJob.model_json_schema(), "predict": PredictJob.model_json_schema(),
                    "run": RunJob.model_json_schema()},
    }
