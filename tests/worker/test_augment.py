"""worker/augment.py and the spec's train.augment: each sample a crop/flip of itself, seeded per (epoch, step)."""
import pytest
import torch
from pydantic import ValidationError

from trainyard.app.spec import TRAIN_EXAMPLE, Augment, TrainParams, parse_spec
from trainyard.worker.augment import BatchAugment, augment_batch
from trainyard.worker.errors import JobError


def images(b: int = 16, c: int = 3, h: int = 8, w: int = 8, dtype=torch.float32) -> torch.Tensor:
    # No zeros (so padding is recognisable) and no mirror symmetry (so a flip is).
    return (torch.rand(b, c, h, w, generator=torch.Generator().manual_seed(1)) + 1).to(dtype)


def crops_of(img: torch.Tensor, p: int, flips: tuple[bool, ...]) -> list[tuple[int, int, bool, torch.Tensor]]:
    """Every crop of one C x H x W image that the augmentation may produce, written out plainly."""
    _, h, w = img.shape
    padded = torch.zeros(img.shape[0], h + 2 * p, w + 2 * p, dtype=img.dtype)
    padded[:, p:p + h, p:p + w] = img
    found = []
    for top in range(2 * p + 1):
        for left in range(2 * p + 1):
            crop = padded[:, top:top + h, left:left + w]
            found += [(top, left, f, crop.flip(-1) if f else crop) for f in flips]
    return found


def matches(x: torch.Tensor, out: torch.Tensor, p: int, flips=(False, True)) -> list[tuple[int, int, bool]]:
    """For each sample, the one (top, left, flipped) that turns its *own* input into its output."""
    params = []
    for i in range(len(x)):
        hits = [(top, left, f) for top, left, f, crop in crops_of(x[i], p, flips) if torch.equal(crop, out[i])]
        assert hits, f"sample {i} is no crop/flip of its own input"
        params.append(hits[0])
    return params


@pytest.mark.parametrize("p,size", [(2, 8), (4, 8), (5, 4)])  # (5, 4): padding wider than the image
def test_each_sample_is_a_crop_and_maybe_a_flip_of_its_own_input(p, size):
    x = images(h=size, w=size)
    out = augment_batch(x, Augment(crop_padding=p), seed=0, epoch=0, step=0)
    assert out.shape == x.shape and out.dtype == x.dtype and not torch.equal(out, x)
    # Sample i comes from input i, so the labels (which the function never sees) stay aligned.
    params = matches(x, out, p)
    assert len({(top, left) for top, left, _ in params}) > 3  # offsets vary between samples
    assert {f for _, _, f in params} == {False, True}


def test_offsets_and_flips_are_uniform():
    b, p = 4096, 2
    aug = BatchAugment(Augment(crop_padding=p), seed=3)
    pick, top, left = aug.draw(b, epoch=0, step=0)
    flipped = pick >= b
    assert torch.equal(pick % b, torch.arange(b))
    for v in (top, torch.where(flipped, 2 * p - left, left)):  # the crop's own left offset
        assert torch.bincount(v, minlength=2 * p + 1).float().div(b).sub(1 / (2 * p + 1)).abs().max() < 0.03
    assert abs(flipped.float().mean() - 0.5) < 0.03


def test_flip_only():
    x = images()
    out = augment_batch(x, Augment(crop_padding=0, horizontal_flip=True), seed=0, epoch=0, step=0)
    flipped = [torch.equal(out[i], x[i].flip(-1)) for i in range(len(x))]
    assert all(flipped[i] or torch.equal(out[i], x[i]) for i in range(len(x)))
    assert 0 < sum(flipped) < len(x)


def test_crop_only():
    x = images()
    out = augment_batch(x, Augment(crop_padding=2, horizontal_flip=False), seed=0, epoch=0, step=0)
    params = matches(x, out, 2, flips=(False,))
    assert len({(top, left) for top, left, _ in params}) > 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.uint8])
def test_shape_dtype_kept_and_input_left_alone(dtype):
    x = images(b=5, c=1, h=6, w=7, dtype=dtype)
    before = x.clone()
    out = augment_batch(x, Augment(crop_padding=3), seed=0, epoch=0, step=0)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(x, before)
    matches(x, out, 3)


def test_channels_last_in_channels_last_out():
    x = images(c=3)
    xc = x.contiguous(memory_format=torch.channels_last)
    aug = Augment(crop_padding=2)
    out = augment_batch(xc, aug, seed=0, epoch=1, step=2)
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
    assert torch.equal(out, augment_batch(x, aug, seed=0, epoch=1, step=2))


def test_a_pure_function_of_seed_epoch_step_and_rank():
    x, aug = images(), Augment(crop_padding=4)
    out = augment_batch(x, aug, seed=7, epoch=2, step=3)
    assert torch.equal(out, augment_batch(x, aug, seed=7, epoch=2, step=3))
    for other in ({"step": 4}, {"epoch": 3}, {"seed": 8}, {"rank": 1}):
        args = {"seed": 7, "epoch": 2, "step": 3, **other}
        assert not torch.equal(out, augment_batch(x, aug, **args)), other


def test_a_resumed_run_draws_what_an_uninterrupted_one_does():
    x = images()
    whole = BatchAugment(Augment(), seed=5)
    uninterrupted = [whole(x, epoch, step) for epoch in range(2) for step in range(4)]
    resumed = BatchAugment(Augment(), seed=5)  # a new process, from epoch 1 step 2
    assert all(torch.equal(resumed(x, 1, step), uninterrupted[4 + step]) for step in (2, 3))


def test_leaves_the_global_rng_alone():
    x = images()
    torch.manual_seed(0)
    state = torch.get_rng_state()
    out = augment_batch(x, Augment(), seed=0, epoch=0, step=0)
    assert torch.equal(torch.get_rng_state(), state)  # dropout's stream goes on as without augmentation
    torch.manual_seed(123)  # and the global seed does not decide the draws
    assert torch.equal(augment_batch(x, Augment(), seed=0, epoch=0, step=0), out)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("channels_last", [False, True])
def test_on_cuda_the_same_as_on_the_cpu(channels_last):
    x = images(b=64, h=32, w=32)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    state = torch.cuda.get_rng_state()
    out = augment_batch(x.cuda(), Augment(), seed=1, epoch=0, step=9)
    assert out.is_cuda and torch.equal(out.cpu(), augment_batch(x, Augment(), seed=1, epoch=0, step=9))
    assert out.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert torch.equal(torch.cuda.get_rng_state(), state)


@pytest.mark.parametrize("shape", [(8, 4), (8, 2, 3), (8, 1, 2, 3, 4)])
def test_non_images_are_a_job_error_naming_train_augment(shape):
    with pytest.raises(JobError, match=r"train\.augment applies to image data"):
        augment_batch(torch.ones(shape), Augment(), seed=0, epoch=0, step=0)
    with pytest.raises(JobError, match=r"train\.augment"):
        BatchAugment(Augment(), seed=0, input_shape=shape[1:])
    BatchAugment(Augment(), seed=0, input_shape=(3, 32, 32))


# -- the spec ---------------------------------------------------------------------------------------

def train_job(augment, dataset: dict | None = None) -> dict:
    return {**TRAIN_EXAMPLE, "model": {"arch": "cnn"}, "data": dataset or {"dataset": "digits"},
            "train": {**TRAIN_EXAMPLE["train"], "augment": augment}}


def test_spec_defaults_keep_augmentation_off():
    assert TrainParams().augment is None
    assert parse_spec(TRAIN_EXAMPLE).train.augment is None
    assert Augment() == Augment(crop_padding=4, horizontal_flip=True)
    job = parse_spec(train_job({"crop_padding": 2}))
    assert job.train.augment == Augment(crop_padding=2, horizontal_flip=True)
    assert parse_spec(job.model_dump(mode="json")) == job  # the stored spec re-validates to the same job


@pytest.mark.parametrize("augment,message", [
    ({"crop_padding": -1}, "crop_padding"), ({"crop_padding": 65}, "crop_padding"),
    ({"crop_padding": "4"}, "crop_padding"), ({"crop_padding": 4.0}, "crop_padding"),
    ({"horizontal_flip": 1}, "horizontal_flip"), ({"crop": 4}, "crop"),
    ({"crop_padding": 0, "horizontal_flip": False}, "changes nothing"),
])
def test_spec_refuses(augment, message):
    with pytest.raises(ValidationError, match=message):
        parse_spec(train_job(augment))


def test_spec_takes_the_limits():
    assert parse_spec(train_job({"crop_padding": 64})).train.augment.crop_padding == 64
    assert parse_spec(train_job({"crop_padding": 0})).train.augment.horizontal_flip


def test_spec_refuses_augmenting_a_built_in_non_image_dataset():
    with pytest.raises(ValidationError, match=r"train\.augment applies to image datasets; iris"):
        parse_spec({**TRAIN_EXAMPLE, "train": {**TRAIN_EXAMPLE["train"], "augment": {}}})
    # Images, or a shape only the worker will know.
    for data in ({"dataset": "fake"}, {"dataset": "cifar10"}, {"dataset": "upload:abc"}, {"dataset": "someplugin"}):
        assert parse_spec(train_job({}, data)).train.augment is not None
