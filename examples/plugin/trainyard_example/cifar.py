"""An entrypoint plugin: the classic CIFAR-10 notebook loop (a small convnet, SGD 0.001 with
momentum 0.9, images through ToTensor and Normalize(0.5, 0.5)), rewritten against trainyard's
Context: it reports each epoch, checkpoints, resumes with ctx.restore(), stops when asked and saves
a model that predict jobs can use. FakeData stands in for CIFAR-10 (nothing is downloaded).
With `"devices": 2` it trains with DistributedDataParallel (ctx.parallel), each rank on its own
part of the images (DistributedSampler).

    {"kind": "run", "entrypoint": "cifar_loop", "config": {"epochs": 5, "size": 1000}}
"""
import time

import torch
import torch.nn.functional as F
import torchvision
import torchvision.transforms as transforms
from torch import nn

CLASSES = ["plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


class Net(nn.Module):
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
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def loaders(config: dict, seed: int, rank: int = 0, world_size: int = 1):
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    size = config.get("size", 1000)
    train = torchvision.datasets.FakeData(size=size, image_size=(3, 32, 32), num_classes=10, transform=transform,
                                          random_offset=0)
    test = torchvision.datasets.FakeData(size=max(10, size // 5), image_size=(3, 32, 32), num_classes=10,
                                         transform=transform, random_offset=size)
    g = torch.Generator().manual_seed(seed)
    batch = config.get("batch_size", 4)
    part = torch.utils.data.DistributedSampler(train, world_size, rank, seed=seed) if world_size > 1 else None
    return (torch.utils.data.DataLoader(train, batch_size=batch, shuffle=part is None, sampler=part, generator=g),
            torch.utils.data.DataLoader(test, batch_size=256))


def cifar_loop(ctx, config: dict) -> dict | None:
    epochs = config.get("epochs", 2)
    ctx.set_total(epochs)
    torch.manual_seed(config.get("seed", 0))
    net = Net().to(ctx.device)
    model = ctx.parallel(net)  # DistributedDataParallel on several devices, net itself on one
    optimizer = torch.optim.SGD(net.parameters(), lr=config.get("lr", 0.001), momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    start = 0
    state = ctx.restore()
    if state is not None:  # a crash, a preemption or a retry: go on from the last checkpoint
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"]
        ctx.log(f"resumed after epoch {start}")
    trainloader, testloader = loaders(config, config.get("seed", 0) + start, ctx.rank, ctx.world_size)

    for epoch in range(start + 1, epochs + 1):
        if isinstance(trainloader.sampler, torch.utils.data.DistributedSampler):
            trainloader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        running_loss, seen, t0 = 0.0, 0, time.perf_counter()
        for inputs, labels in trainloader:
            if ctx.should_stop():
                return None  # stopped: the last checkpoint is where the next run starts
            inputs, labels = inputs.to(ctx.device), labels.to(ctx.device)
            optimizer.zero_grad()
            loss = criterion(model(inputs), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item() * len(labels)
            seen += len(labels)
            time.sleep(config.get("step_sleep", 0))
        if ctx.rank > 0:  # rank 0 evaluates, reports and checkpoints for the job
            continue
        val_loss, val_accuracy = evaluate(net, testloader, ctx.device)
        ctx.report(epoch, train_loss=running_loss / seen, val_loss=val_loss, val_accuracy=val_accuracy,
                   samples_per_s=seen / (time.perf_counter() - t0))
        ctx.checkpoint({"epoch": epoch, "model": net.state_dict(), "optimizer": optimizer.state_dict()})

    if ctx.rank > 0:
        return None
    ctx.save_model(net, arch="cifar_net", input_shape=[3, 32, 32], class_names=CLASSES, dataset="fake",
                   note="the CIFAR-10 notebook's Net, trained by cifar_loop")
    return {"val_accuracy": evaluate(net, testloader, ctx.device)[1], "epochs": epochs}


@torch.no_grad()
def evaluate(net: nn.Module, loader, device) -> tuple[float, float]:
    """Mean loss and accuracy on the held-out images."""
    net.eval()
    loss = correct = total = 0
    for inputs, labels in loader:
        inputs, labels = inputs.to(device), labels.to(device)
        logits = net(inputs)
        loss += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(1) == labels).sum().item()
        total += len(labels)
    net.train()
    return loss / total, correct / total
