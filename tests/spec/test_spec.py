"""app/spec/ on its own: strict types, full-string names, and stored specs that hold only what applies."""
import pytest
from pydantic import ValidationError

from trainyard.app.spec import TRAIN_EXAMPLE, parse_spec


def test_a_stored_spec_keeps_only_the_fields_that_apply():
    iris = parse_spec(TRAIN_EXAMPLE).model_dump(mode="json")
    assert set(iris["model"]) == {"arch", "hidden", "activation", "dropout", "num_classes"}
    assert set(iris["data"]) == {"dataset", "val_fraction", "split_seed"}  # no FakeData shape on Iris
    assert "momentum" not in iris["train"]  # Adam
    assert parse_spec(iris).model_dump(mode="json") == iris  # what the worker re-validates is the same job
    fake = parse_spec({"kind": "train", "model": {"arch": "cifar_net"}, "data": {"dataset": "fake"},
                       "train": {"optimizer": "sgd"}}).model_dump(mode="json")
    assert fake["model"] == {"arch": "cifar_net", "num_classes": None}
    assert fake["data"]["image_size"] == [3, 32, 32] and fake["train"]["momentum"] == 0.9


@pytest.mark.parametrize("patch,field", [
    ({"train": {"epochs": "5"}}, "epochs"), ({"train": {"epochs": 5.0}}, "epochs"),
    ({"train": {"lr": True}}, "lr"), ({"train": {"compile": 1}}, "compile"),
    ({"data": {"dataset": "upload:abc\n"}}, "dataset"), ({"device": "cuda:1\n"}, "device"),
    ({"data": {"dataset": "fake", "image_size": [3, 512, 512], "size": 200_000}}, "data"),
    ({"data": {"dataset": "fake", "image_size": [5, 32, 32]}}, "image_size"),
    ({"devices": 0}, "devices"), ({"devices": 17}, "devices"), ({"devices": "2"}, "devices"),
    ({"devices": 2, "device": "cuda:1"}, "devices"),
    ({"devices": 2, "device": "cuda", "resources": {"gpu_memory_gb": 8}}, "devices"),
])
def test_refused(patch, field):
    raw = {**TRAIN_EXAMPLE, **{k: ({**TRAIN_EXAMPLE.get(k, {}), **v} if isinstance(v, dict) else v)
                               for k, v in patch.items()}}
    with pytest.raises(ValidationError) as e:
        parse_spec(raw)
    assert field in str(e.value)


def test_integers_are_valid_floats():
    assert parse_spec({**TRAIN_EXAMPLE, "train": {**TRAIN_EXAMPLE["train"], "lr": 1}}).train.lr == 1.0


def test_devices_is_for_train_and_run_jobs():
    assert parse_spec({**TRAIN_EXAMPLE, "devices": 4, "device": "cuda"}).devices == 4
    assert parse_spec({"kind": "run", "entrypoint": "x", "devices": 2}).device_count == 2
    assert parse_spec({"kind": "predict", "model_job": 1, "inputs": [[1.0]]}).device_count == 1
    with pytest.raises(ValidationError, match="devices"):
        parse_spec({"kind": "predict", "model_job": 1, "inputs": [[1.0]], "devices": 2})
