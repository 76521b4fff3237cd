"""The API's torch-free parameter counts agree with the models the workers really build."""
import pytest
import torchvision

from trainyard.app.spec import TORCHVISION_ARCHS, ModelSpec
from trainyard.app.spec.model_size import TORCHVISION_PARAMS, parameter_count
from trainyard.worker import nets


def built(spec: ModelSpec, shape: tuple[int, ...], classes: int) -> int:
    return nets.count_parameters(nets.build_model(spec, shape, classes))


@pytest.mark.parametrize("model,shape,classes", [
    ({"arch": "mlp"}, (4,), 3),
    ({"arch": "mlp", "hidden": [8, 9]}, (4,), 3),
    ({"arch": "mlp", "hidden": [16, 16, 16], "num_classes": 12}, (1, 8, 8), 10),
    ({"arch": "cnn"}, (1, 8, 8), 10),
    ({"arch": "cnn", "channels": [4, 8, 16], "kernel_size": 5, "batch_norm": False}, (3, 32, 32), 7),
    ({"arch": "cifar_net"}, (3, 32, 32), 10),
    ({"arch": "cifar_net", "num_classes": 100}, (1, 32, 32), 10),
])
def test_builtin_counts_match_the_built_model(model, shape, classes):
    spec = ModelSpec(**model)
    assert parameter_count(spec, shape, classes) == built(spec, shape, classes)


def test_the_table_covers_every_torchvision_arch():
    assert set(TORCHVISION_PARAMS) == set(TORCHVISION_ARCHS)


@pytest.mark.slow
@pytest.mark.parametrize("arch", TORCHVISION_ARCHS)
def test_torchvision_counts_match_the_built_model(arch):
    spec = ModelSpec(arch=arch)
    if arch.startswith("vit_"):
        for shape, classes in (((3, 32, 32), 10), ((1, 64, 64), 3)):
            assert parameter_count(spec, shape, classes) == built(spec, shape, classes)
        return
    # A 1-channel input only adds a parameter-free wrapper (nets.ExpandChannels): the same count.
    kw = {"aux_logits": False, "init_weights": True} if arch == "googlenet" else {}
    model = torchvision.models.get_model(arch, weights=None, num_classes=37, **kw)
    assert parameter_count(spec, (3, 64, 64), 37) == nets.count_parameters(model)
    assert parameter_count(spec, (1, 64, 64), 37) == nets.count_parameters(model)


def test_a_two_field_spec_can_ask_for_billions():
    spec = ModelSpec(arch="mlp", hidden=[65536, 65536])
    assert parameter_count(spec, (4,), 3) > 4 * 10**9
