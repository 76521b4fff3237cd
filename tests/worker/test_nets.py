"""worker/nets.py: the tutorial-compatible mlp and cifar_net, the cnn, torchvision models, shape checks."""
import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from trainyard.app.spec import ACTIVATIONS, TORCHVISION_ARCHS, ModelSpec
from trainyard.worker import nets
from trainyard.worker.errors import JobError


class TutorialModel(nn.Module):
    """Seed 000's Iris Model, verbatim."""

    def __init__(self, in_features=4, h1=8, h2=9, out_features=3):
        super().__init__()
        self.fc1 = nn.Linear(in_features, h1)
        self.fc2 = nn.Linear(h1, h2)
        self.out = nn.Linear(h2, out_features)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.out(x)


class TutorialNet(nn.Module):
    """Seed 002's CIFAR-10 Net, verbatim."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def _same_parameters(a: nn.Module, b: nn.Module) -> None:
    pa, pb = list(a.parameters()), list(b.parameters())
    assert [p.shape for p in pa] == [p.shape for p in pb]
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)


def test_mlp_initialises_like_the_iris_tutorial():
    torch.manual_seed(32)
    want = TutorialModel()
    torch.manual_seed(32)
    got = nets.build_model(ModelSpec(arch="mlp", hidden=[8, 9]), (4,), 3)
    _same_parameters(got, want)
    x = torch.randn(5, 4)
    assert torch.equal(got(x), want(x))


def test_mlp_layers():
    model = nets.build_model(ModelSpec(arch="mlp", activation="gelu", dropout=0.3), (1, 8, 8), 10)
    names = [name for name, _ in model.named_children()]
    assert names == ["flatten", "fc1", "act1", "drop1", "out"]
    assert model.fc1.in_features == 64 and model.fc1.out_features == 64  # default hidden [64]
    assert isinstance(model.act1, nn.GELU) and model.drop1.p == 0.3
    assert model(torch.randn(3, 1, 8, 8)).shape == (3, 10)
    for activation in ACTIVATIONS:
        model = nets.build_model(ModelSpec(arch="mlp", activation=activation), (4,), 3)
        assert model(torch.randn(2, 4)).shape == (2, 3)


def test_cifar_net_is_the_tutorial_net():
    torch.manual_seed(0)
    want = TutorialNet()
    torch.manual_seed(0)
    got = nets.build_model(ModelSpec(arch="cifar_net"), (3, 32, 32), 10)
    _same_parameters(got, want)
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(got(x), want(x))
    gray = nets.build_model(ModelSpec(arch="cifar_net"), (1, 32, 32), 4)
    assert gray(torch.randn(2, 1, 32, 32)).shape == (2, 4)
    with pytest.raises(JobError, match=r"\(C, 32, 32\)"):
        nets.build_model(ModelSpec(arch="cifar_net"), (1, 28, 28), 10)


def test_cnn_blocks_and_pooling():
    model = nets.build_model(ModelSpec(arch="cnn"), (1, 8, 8), 10)
    convs = [m for m in model if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [32, 64] and convs[0].padding == (1, 1)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model) == 2
    assert sum(isinstance(m, nn.MaxPool2d) for m in model) == 2  # 8 -> 4 -> 2
    assert model(torch.randn(3, 1, 8, 8)).shape == (3, 10)
    # 4x4 input: one pool to 2x2, then the spatial size would drop below 2, so no more pooling.
    small = nets.build_model(ModelSpec(arch="cnn", channels=[4, 4, 4], batch_norm=False, kernel_size=5), (3, 4, 4), 2)
    assert sum(isinstance(m, nn.MaxPool2d) for m in small) == 1
    assert not any(isinstance(m, nn.BatchNorm2d) for m in small)
    assert small(torch.randn(2, 3, 4, 4)).shape == (2, 2)
    with pytest.raises(JobError, match="mlp"):
        nets.build_model(ModelSpec(arch="cnn"), (4,), 3)


def test_num_classes_override():
    model = nets.build_model(ModelSpec(arch="mlp", num_classes=5), (4,), 3)
    assert model.out.out_features == 5
    with pytest.raises(JobError, match="3 classes"):
        nets.build_model(ModelSpec(arch="mlp", num_classes=2), (4,), 3)


def test_torchvision_arch_names_exist():
    available = set(torchvision.models.list_models(module=torchvision.models))
    assert set(TORCHVISION_ARCHS) <= available


@pytest.mark.parametrize("arch", ["resnet18", "mobilenet_v3_small"])
def test_torchvision_forward(arch):
    model = nets.build_model(ModelSpec(arch=arch), (3, 32, 32), 7).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_torchvision_gray_images_are_expanded_identically_on_rebuild():
    spec = ModelSpec(arch="resnet18")
    model = nets.build_model(spec, (1, 28, 28), 10).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    keys = list(model.state_dict())
    assert keys[0].startswith("net.")
    rebuilt = nets.build_model(spec, (1, 28, 28), 10)
    rebuilt.load_state_dict(model.state_dict())  # strict: same wrapper, same keys
    with pytest.raises(JobError, match="1 or 3"):
        nets.build_model(spec, (2, 32, 32), 10)
    with pytest.raises(JobError):
        nets.build_model(spec, (4,), 3)


def test_vit_needs_a_patch_multiple():
    with pytest.raises(JobError, match="divisible by 16"):
        nets.build_model(ModelSpec(arch="vit_b_16"), (1, 28, 28), 10)


def test_check_input_turns_shape_errors_into_job_errors():
    model = nn.Sequential(nn.Flatten(), nn.Linear(10, 2))
    nets.check_input(model, (10,), torch.device("cpu"), "mlp")
    with pytest.raises(JobError, match=r"shape \(3, 4\)"):
        nets.check_input(model, (3, 4), torch.device("cpu"), "custom")
    assert model.training  # mode restored


def test_count_parameters():
    assert nets.count_parameters(nets.build_model(ModelSpec(arch="mlp", hidden=[8, 9]), (4,), 3)) == 151
