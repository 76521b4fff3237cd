"""Parameter counts of the built-in architectures, computed without torch.

The API refuses a train job whose model would be larger than `max_parameters` before it reaches a
worker (a two-field spec can ask for billions of weights). The counts follow worker/nets.py
exactly; tests/spec/test_model_size.py builds every architecture with torch and compares.
"""
import math

from trainyard.app.spec import ModelSpec

# torchvision classifiers: (parameters without the classifier's weights, parameters per class:
# the classifier's input width + 1 for its bias). Counted from torchvision 0.29's builders with
# weights=None; tests/spec/test_model_size.py re-counts them against the installed torchvision.
TORCHVISION_PARAMS = {
    "alexnet": (57003840, 4097), "convnext_tiny": (27820128, 769), "convnext_small": (49454688, 769),
    "densenet121": (6953856, 1025), "densenet161": (26472000, 2209), "densenet169": (12484480, 1665),
    "efficientnet_b0": (4007548, 1281), "efficientnet_b1": (6513184, 1281),
    "efficientnet_v2_s": (20177488, 1281), "googlenet": (5599904, 1025), "mnasnet0_5": (937512, 1281),
    "mnasnet1_0": (3102312, 1281), "mobilenet_v2": (2223872, 1281), "mobilenet_v3_large": (4202032, 1281),
    "mobilenet_v3_small": (1517856, 1025), "regnet_x_400mf": (5094976, 401), "regnet_y_400mf": (3903144, 441),
    "resnet18": (11176512, 513), "resnet34": (21284672, 513), "resnet50": (23508032, 2049),
    "resnet101": (42500160, 2049), "resnext50_32x4d": (22979904, 2049), "shufflenet_v2_x0_5": (341792, 1025),
    "shufflenet_v2_x1_0": (1253604, 1025), "squeezenet1_0": (735424, 513), "squeezenet1_1": (722496, 513),
    "swin_t": (27519354, 769), "vgg11": (128766336, 4097), "vgg11_bn": (128771840, 4097),
    "vgg16": (134260544, 4097), "wide_resnet50_2": (66834240, 2049),
    # vit_b_16 at its default 224x224 input; its position embedding grows with the image (below).
    "vit_b_16": (85798656, 769),
}
_VIT_WIDTH, _VIT_PATCH, _VIT_DEFAULT_TOKENS = 768, 16, (224 // 16) ** 2 + 1


def parameter_count(spec: ModelSpec, input_shape: tuple[int, ...], data_classes: int) -> int:
    """Trainable parameters of the model worker/nets.build_model would build for these inputs."""
    classes = spec.num_classes or data_classes
    if spec.arch == "mlp":
        widths = [math.prod(input_shape), *(spec.hidden or [64]), classes]
        return sum(a * b + b for a, b in zip(widths, widths[1:]))
    if spec.arch == "cifar_net":
        c = input_shape[0] if input_shape else 3
        return (c * 6 * 25 + 6) + (6 * 16 * 25 + 16) + (400 * 120 + 120) + (120 * 84 + 84) + (84 * classes + classes)
    if spec.arch == "cnn":
        c_in, k, total = (input_shape[0] if input_shape else 1), spec.kernel_size, 0
        for c in spec.channels or [32, 64]:
            total += c_in * c * k * k + (2 * c if spec.batch_norm else c)  # bias, or batch norm's weight + bias
            c_in = c
        return total + c_in * classes + classes
    base, per_class = TORCHVISION_PARAMS[spec.arch]
    if spec.arch == "vit_b_16" and len(input_shape) == 3:
        tokens = (input_shape[1] // _VIT_PATCH) * (input_shape[2] // _VIT_PATCH) + 1
        base += (tokens - _VIT_DEFAULT_TOKENS) * _VIT_WIDTH
    return base + per_class * classes
