"""app/core/device_names.py: the one device vocabulary."""
import pytest

from trainyard.app.core import device_names as dn


def test_worker_devices_are_concrete():
    assert dn.for_worker("auto", 0) == "cpu" and dn.for_worker("auto", 2) == "cuda:0"
    assert dn.for_worker("cuda", 1) == "cuda:0" and dn.for_worker("cuda:3", 8) == "cuda:3"
    assert dn.for_worker("cpu", 8) == "cpu"
    for bad in ("tpu", "cuda:", "cuda:0\n", "CPU", "cuda:123"):
        with pytest.raises(ValueError):
            dn.for_worker(bad, 1)


def test_which_requests_a_worker_takes():
    assert dn.accepted_by("cpu") == ["auto", "cpu"]
    assert dn.accepted_by("cuda:2") == ["auto", "cuda", "cuda:2"]
    assert dn.cuda_index("cuda:7") == 7 and dn.cuda_index("cuda") == 0 and dn.cuda_index("cpu") is None
