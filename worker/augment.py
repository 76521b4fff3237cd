"""Image augmentation of a training batch, on the batch's device: random crop after zero padding, and
horizontal flip (the spec's train.augment, app/spec/train.py Augment).

This module owns how a batch is augmented and which augmentation each sample gets. The device does
two whole-batch passes (one F.pad, one gather of every sample's flipped or unflipped crop), keeping
the batch's memory format (contiguous or channels_last) and dtype; there is no Python loop over
samples.

The random parameters are a pure function of (seed, epoch, step, rank): a small CPU generator is
re-seeded from them at every call, so a job resumed mid-epoch from a checkpoint draws exactly what
an uninterrupted run draws, with no generator state to save, and the global RNG (dropout's stream)
and the loop's shuffle generator are never touched. The draws do not depend on the device either.

Pixels: batches arrive normalised (worker/data.py), so padding adds zeros of the *normalised*
input, i.e. the dataset's mean pixel (mid-grey for CIFAR-10, fake data and uploads). That is what
torchvision's RandomCrop(padding=p) does on normalised tensors; RandomCrop on PIL images before
Normalize, as the classic CIFAR recipe writes it, would pad with black instead.
"""
import hashlib
import struct
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from trainyard.app.spec import Augment
from trainyard.worker.errors import JobError


def check_images(input_shape: Sequence[int]) -> None:
    """Raise JobError unless samples are images (C, H, W): the spec cannot know an upload's or a plugin's shape."""
    if len(input_shape) != 3:
        raise JobError(f"train.augment applies to image data (samples of shape C x H x W); this dataset's "
                       f"samples have shape {tuple(input_shape)}: drop train.augment or use an image dataset")


def stream_seed(seed: int, epoch: int, step: int, rank: int = 0) -> int:
    """The seed of one batch's draws. Hashed, so that nearby (epoch, step) pairs give unrelated
    streams and none coincides with the shuffle generator's, which is seeded with `seed` itself."""
    key = struct.pack("<4Q", seed, epoch, step, rank)
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, person=b"trainyard-augmnt").digest(), "little")


class BatchAugment:
    """Built once per run; called on each training batch: `xb = augment(xb, epoch, step)`.

    `rank`: on several devices each rank augments its own shard of the global batch, so its draws
    must differ from the other ranks' (the same seed for all would flip and crop the shards alike).
    """

    def __init__(self, aug: Augment, seed: int, input_shape: Sequence[int] | None = None, rank: int = 0):
        if input_shape is not None:
            check_images(input_shape)
        self.padding, self.flip = aug.crop_padding, aug.horizontal_flip
        self.seed, self.rank = seed, rank
        self._gen = torch.Generator()  # re-seeded on every call: it carries no state between batches

    def __call__(self, xb: Tensor, epoch: int, step: int) -> Tensor:
        if xb.ndim != 4:
            check_images(xb.shape[1:])
        p = self.padding
        if not p and not self.flip:
            return xb
        b, c, h, w = xb.shape
        params = self.draw(b, epoch, step)
        if xb.device.type == "cuda":  # pinned, the copy queues behind the GPU's work instead of waiting for it
            params = params.pin_memory()
        pick, top, left = params.to(xb.device, non_blocking=True)
        # Each output pixel's offset in its padded image, gathered in one pass: a flipped sample reads
        # its crop's columns right to left.
        flipped = pick >= b
        left = torch.where(flipped, 2 * p - left, left)  # the crop's left edge in the unflipped image
        rows = top[:, None] + torch.arange(h, device=xb.device)
        cols = left[:, None] + torch.arange(w, device=xb.device)
        cols = torch.where(flipped[:, None], cols.flip(1), cols)
        offsets = (rows[:, :, None] * (w + 2 * p) + cols[:, None, :]).view(b, 1, h * w).expand(b, c, h * w)
        source = F.pad(xb, (p, p, p, p)) if p else xb
        out = source.contiguous().view(b, c, -1).gather(2, offsets).view(b, c, h, w)
        # The model may have been converted to channels_last; it gets the layout it was given.
        if not xb.is_contiguous() and xb.is_contiguous(memory_format=torch.channels_last):
            return out.contiguous(memory_format=torch.channels_last)
        return out

    def draw(self, b: int, epoch: int, step: int) -> Tensor:
        """This batch's parameters, on the CPU: for each sample, the row of the source to crop from
        (sample i, or B + i for its mirror image) and the crop's top and left offsets into the padded
        image. Offsets are drawn uniformly from 0..2p as RandomCrop draws them; a sample's crop is then
        flipped with probability 1/2 (a crop of the mirror image at left offset 2p - left)."""
        g = self._gen.manual_seed(stream_seed(self.seed, epoch, step, self.rank))
        p = self.padding
        top, left = torch.randint(0, 2 * p + 1, (2, b), generator=g)
        pick = torch.arange(b)
        if self.flip:
            flipped = torch.randint(0, 2, (b,), generator=g, dtype=torch.bool)
            pick = torch.where(flipped, pick + b, pick)
            left = torch.where(flipped, 2 * p - left, left)
        return torch.stack((pick, top, left))


def augment_batch(xb: Tensor, aug: Augment, seed: int, epoch: int, step: int, rank: int = 0) -> Tensor:
    """One batch augmented: the same (seed, epoch, step, rank) always gives the same output."""
    return BatchAugment(aug, seed, rank=rank)(xb, epoch, step)
