"""Hand-written PyTorch training loops, the yardsticks of bench/train_throughput.py.

Run one as `python -m bench.loops CASE LOOP EPOCHS DATA_DIR [DEVICE [THREADS]]`; it prints a JSON
line with the training seconds of each epoch (evaluation excluded, as in the service's samples_per_s).
THREADS sets torch's intra-op thread count (bench/train_throughput.py tries each and keeps the best).
- seed000: the classic notebook Iris loop (full batch, Adam, model.forward per epoch, losses kept in
  a list), as written in the project's founding tutorials.
- seed002: the classic CIFAR-10 notebook loop: torchvision FakeData through ToTensor + Normalize,
  a DataLoader with shuffle and num_workers=2, `.to(device)` per batch, `loss.item()` per step.
- tight: the best plain loop we know: tensors in memory, a shuffled index per epoch, batches
  sliced from it (no gather at all when one batch holds the whole split), losses accumulated on the
  device and read once per epoch; the service's own optimizer (train_setup.make_optimizer: fused where
  PyTorch has the kernel), where seed000 and seed002 keep the tutorials' per-tensor ones. Where the spec
  asks, the model and each batch in channels_last and the model through `torch.compile(model)`, as a
  user writes them (the compile happens in the first epoch, which no rate counts).
Every epoch's clock stops only once the device has finished the epoch's work (`now`): on CUDA the
loops' calls return as soon as the kernels are queued, and their clock would measure the launches.
Every loop runs with the numerics the service applies to the same spec (worker/torch_devices/switches.py:
TF32, cuDNN's autotuner, determinism; the tight loop its precision, channels_last and compile too), applied by
the same function, and prints them (`numerics`, and `model_switches`: channels_last, compile, the optimizer)
for bench/train_throughput.py to show beside the service's: a ratio then measures the service, not a switch
one side had on. It also prints the model's training FLOPs per sample and the device's name, for the MFU.
"""
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from bench import flops
from bench.cases import spec_for
from trainyard.app.spec import TrainJob, parse_spec
from trainyard.worker import data, nets, train_setup
from trainyard.worker.torch_devices import switches


def now(device: torch.device) -> float:
    """time.perf_counter(), read once the device has done the work queued on it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def seed000(spec, d, device, epochs, applied):
    applied["optimizer"] = "per-tensor"
    torch.manual_seed(spec.train.seed)
    model = nets.build_model(spec.model, d.input_shape, len(d.class_names)).to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=spec.train.lr)
    X_train, y_train = d.x_train.to(device), d.y_train.to(device)
    seconds, losses = [], []
    for _i in range(epochs):
        start = now(device)
        y_pred = model.forward(X_train)
        loss = criterion(y_pred, y_train)
        losses.append(loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seconds.append(now(device) - start)
    return seconds, len(y_train)


def tight(spec, d, device, epochs, applied):
    torch.manual_seed(spec.train.seed)
    model = nets.build_model(spec.model, d.input_shape, len(d.class_names)).to(device)
    channels_last = switches.use_channels_last(spec.train.channels_last, d.input_shape, applied)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    criterion = nn.CrossEntropyLoss()
    optimizer = train_setup.make_optimizer(spec.train, model, applied)
    forward = compiled(model, spec.train.compile, applied)
    precision, _ = switches.resolve_precision(device, spec.train.precision)
    scaler = switches.grad_scaler(device, precision)
    x, y, bs = d.x_train.to(device), d.y_train.to(device), spec.train.batch_size
    seconds = []
    for _ in range(epochs):
        start = now(device)
        model.train()
        total = torch.zeros((), device=device)
        perm = torch.randperm(len(y), device=device) if bs < len(y) else None
        for i in range(0, len(y), bs):
            if perm is None:  # one batch of every sample: its order cannot change the step
                xb, yb = x, y
            else:
                idx = perm[i:i + bs]
                xb, yb = x[idx], y[idx]
            if channels_last:
                xb = xb.contiguous(memory_format=torch.channels_last)
            with switches.autocast(device, precision):
                logits = forward(xb)
            loss = criterion(logits.float(), yb)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            total += loss.detach()
        total.item()
        seconds.append(now(device) - start)
    return seconds, len(y)


def compiled(model: nn.Module, wanted: bool, applied: dict) -> nn.Module:
    """torch.compile(model) where the spec asks, as a user writes it (no warm-up, no fallback: torch compiles at
    the first batch, and a failure fails the run); recorded as the service records it."""
    applied["compile"] = "on" if wanted else "off"
    return torch.compile(model) if wanted else model  # type: ignore[return-value]  # an OptimizedModule


def seed002(spec, d, device, epochs, applied):
    import torchvision
    import torchvision.transforms as transforms

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    ds = spec.data
    fake = torchvision.datasets.FakeData(size=ds.size, image_size=tuple(ds.image_size), num_classes=ds.num_classes,
                                         transform=transform, random_offset=ds.split_seed * ds.size)
    train_idx, _ = data.split_indices(ds.size, ds.val_fraction, ds.split_seed)
    trainset = torch.utils.data.Subset(fake, train_idx.tolist())
    trainloader = torch.utils.data.DataLoader(trainset, batch_size=spec.train.batch_size, shuffle=True,
                                              num_workers=2)
    torch.manual_seed(spec.train.seed)
    net = nets.build_model(spec.model, d.input_shape, len(d.class_names)).to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=spec.train.lr, momentum=spec.train.momentum)
    applied["optimizer"] = "per-tensor"
    seconds = []
    for _epoch in range(epochs):
        start = now(device)
        running_loss = 0.0
        for _i, batch in enumerate(trainloader, 0):
            inputs, labels = batch[0].to(device), batch[1].to(device)
            optimizer.zero_grad()
            outputs = net(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
        seconds.append(now(device) - start)
    return seconds, len(trainset)


LOOPS = {"seed000": seed000, "seed002": seed002, "tight": tight}


def main() -> None:
    case, loop, epochs, data_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    # The device the service's job runs on, so that both sides are measured on the same one.
    device = torch.device(sys.argv[5] if len(sys.argv) > 5 else "cpu")
    spec = parse_spec(spec_for(case, str(device)))
    assert isinstance(spec, TrainJob), f"{case} is not a training job"
    if len(sys.argv) > 6:
        torch.set_num_threads(int(sys.argv[6]))
    d = data.load(spec.data, data_dir)
    applied = switches.configure(device, spec.train)  # the service's own switches, for this spec and device
    # What a loop leaves alone stays as the tutorials have it.
    applied.update(channels_last="off", compile="off")
    seconds, n = LOOPS[loop](spec, d, device, epochs, applied)
    model = nets.build_model(spec.model, d.input_shape, len(d.class_names))
    print(json.dumps({"seconds": seconds, "samples": n, "numerics": numerics(applied),
                      "model_switches": model_switches(applied), "precision": applied["precision"],
                      "tf32": applied["tf32"] == "on", "device_name": flops.device_name(device),
                      "flops_per_sample": flops.train_flops_per_sample(model, d.input_shape)}))


def numerics(applied: dict) -> str:
    """The switches that change a step's arithmetic or speed, in one line: the service's job result holds the
    same `applied` keys."""
    return ", ".join(f"{key} {applied.get(key, '-')}" for key in NUMERICS)


NUMERICS = ("tf32", "cudnn_benchmark", "deterministic", "precision")


def model_switches(applied: dict) -> str:
    """How the model runs, in one line (the service's job result holds the same `applied` keys)."""
    return ", ".join(f"{key} {applied.get(key, '-')}" for key in MODEL_SWITCHES)


MODEL_SWITCHES = ("channels_last", "compile", "optimizer")


if __name__ == "__main__":
    main()
