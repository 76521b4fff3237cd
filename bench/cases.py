"""The training jobs the benchmarks run: the seeds' models and data, and image models as GPU users train them,
as service job specs, with the hand-written loops (bench/loops.py) each is measured against and the ratio the
service must reach."""
import copy

IRIS = {"kind": "train", "name": "bench-iris", "model": {"arch": "mlp", "hidden": [8, 9]},
        "data": {"dataset": "iris", "val_fraction": 0.2, "split_seed": 33},
        "train": {"epochs": 100, "batch_size": 120, "optimizer": "adam", "lr": 0.01, "seed": 32}, "device": "cpu"}

FAKE_SIZE = 2500  # FakeData images; the default val_fraction 0.2 leaves 2000 to train on
FULL_BATCH = 2000


def cifar(batch_size: int, epochs: int) -> dict:
    """The classic CIFAR-10 convnet and notebook settings (SGD 0.001, momentum 0.9) on FakeData shaped like CIFAR-10."""
    name = "full" if batch_size == FULL_BATCH else f"b{batch_size}"
    return {"kind": "train", "name": f"bench-cifar-{name}", "model": {"arch": "cifar_net"},
            "data": {"dataset": "fake", "image_size": [3, 32, 32], "num_classes": 10, "size": FAKE_SIZE},
            "train": {"epochs": epochs, "batch_size": batch_size, "optimizer": "sgd", "lr": 0.001, "momentum": 0.9},
            "device": "cpu"}


DIGITS = {"kind": "train", "name": "bench-digits", "model": {"arch": "cnn"}, "data": {"dataset": "digits"},
          "train": {"epochs": 6, "batch_size": 64, "optimizer": "adam", "lr": 0.001}, "device": "cpu"}

# ResNet-18 on CIFAR-shaped FakeData as a GPU user trains it: batch 256, bf16 autocast, channels_last, SGD with
# momentum and weight decay. 12,800 images leave 10,240 to train on, 40 full batches: no short last batch, which
# would make torch.compile compile a second shape.
IMAGE_SIZE, IMAGE_BATCH = 12_800, 256
# On the CPU (a smoke run, bench/ and the tests) the same model and image shape at 80 images, 64 to train on in
# batches of 16: a ResNet-18 step at batch 256 takes seconds there.
CPU_IMAGE_SIZE, CPU_IMAGE_BATCH = 80, 16


def resnet18(compile: bool) -> dict:
    return {"kind": "train", "name": "bench-resnet18-bf16-cl" + ("-compile" if compile else ""),
            "model": {"arch": "resnet18"},
            "data": {"dataset": "fake", "image_size": [3, 32, 32], "num_classes": 10, "size": IMAGE_SIZE},
            "train": {"epochs": 4, "batch_size": IMAGE_BATCH, "optimizer": "sgd", "lr": 0.01, "momentum": 0.9,
                      "weight_decay": 5e-4, "precision": "bf16", "channels_last": True, "compile": compile},
            "device": "cpu"}


CASES = {"iris-mlp": IRIS, "cifar_net-b4": cifar(4, 3), "cifar_net-b64": cifar(64, 6),
         "cifar_net-full": cifar(FULL_BATCH, 8), "digits-cnn": DIGITS,
         "resnet18-bf16-cl": resnet18(compile=False), "resnet18-bf16-cl-compile": resnet18(compile=True)}
# Names that stand for several cases in bench.train_throughput --cases.
GROUPS = {"image": ["resnet18-bf16-cl", "resnet18-bf16-cl-compile"]}
# Which hand-written loops each case is measured against.
YARDSTICKS = {"iris-mlp": ["seed000", "tight"], "cifar_net-b4": ["tight", "seed002"],
              "cifar_net-b64": ["tight", "seed002"], "cifar_net-full": ["tight"], "digits-cnn": ["tight"],
              "resnet18-bf16-cl": ["tight"], "resnet18-bf16-cl-compile": ["tight"]}
# The service / yardstick ratio each pairing must reach (issue 23); the others are shown for comparison.
TARGETS = {("iris-mlp", "seed000"): 0.95, ("cifar_net-b4", "tight"): 0.97, ("cifar_net-b64", "tight"): 0.97,
           ("cifar_net-full", "tight"): 0.97}


def spec_for(case: str, device: str) -> dict:
    """The case's job spec on device (cpu, cuda:N), the same for the service and the loops: the image cases at
    CPU_IMAGE_SIZE on the CPU."""
    spec = copy.deepcopy(CASES[case])
    spec["device"] = device
    if device == "cpu" and case in GROUPS["image"]:
        spec["data"]["size"], spec["train"]["batch_size"] = CPU_IMAGE_SIZE, CPU_IMAGE_BATCH
    return spec


def expand(names: str) -> list[str]:
    """A --cases value (case names and GROUPS' names, comma-separated) as case names, in order, once each."""
    out: list[str] = []
    for name in names.split(","):
        for case in GROUPS.get(name, [name]):
            if case not in out:
                out.append(case)
    return out
