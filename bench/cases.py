"""The training jobs the benchmarks run: the seeds' models and data, as service job specs."""

IRIS = {"kind": "train", "name": "bench-iris", "model": {"arch": "mlp", "hidden": [8, 9]},
        "data": {"dataset": "iris", "val_fraction": 0.2, "split_seed": 33},
        "train": {"epochs": 100, "batch_size": 120, "optimizer": "adam", "lr": 0.01, "seed": 32}, "device": "cpu"}


def cifar(batch_size: int, epochs: int) -> dict:
    """The classic CIFAR-10 convnet and notebook settings (SGD 0.001, momentum 0.9) on FakeData shaped like CIFAR-10."""
    return {"kind": "train", "name": f"bench-cifar-b{batch_size}", "model": {"arch": "cifar_net"},
            "data": {"dataset": "fake", "image_size": [3, 32, 32], "num_classes": 10, "size": 2500},
            "train": {"epochs": epochs, "batch_size": batch_size, "optimizer": "sgd", "lr": 0.001, "momentum": 0.9},
            "device": "cpu"}


DIGITS = {"kind": "train", "name": "bench-digits", "model": {"arch": "cnn"}, "data": {"dataset": "digits"},
          "train": {"epochs": 6, "batch_size": 64, "optimizer": "adam", "lr": 0.001}, "device": "cpu"}

CASES = {"iris-mlp": IRIS, "cifar_net-b4": cifar(4, 3), "cifar_net-b64": cifar(64, 6), "digits-cnn": DIGITS}
# Which hand-written loops each case is measured against.
YARDSTICKS = {"iris-mlp": ["seed000", "tight"], "cifar_net-b4": ["tight", "seed002"],
              "cifar_net-b64": ["tight", "seed002"], "digits-cnn": ["tight"]}
