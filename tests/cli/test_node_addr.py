"""TRAINYARD_NODE_ADDR: the address other hosts reach a host's ranks at. Never a loopback one, which would
let a rank on another host dial itself; a refused setting is one line naming the variable, not a traceback.
/workers shows each worker's (tests/worker/test_hosts_netns.py, on hosts of their own)."""
import subprocess
import sys

import pytest
from pydantic import ValidationError

from trainyard.app.core.settings import Settings


@pytest.mark.parametrize("addr", ["10.0.0.5", "gpu-3.lan", "fd00::1", "[fd00::1]", "node7"])
def test_a_routable_address_or_name_is_kept(addr):
    assert Settings(node_addr=f" {addr} ").node_addr == addr


@pytest.mark.parametrize("addr", ["127.0.0.1", "127.0.1.1", "::1", "0.0.0.0", "::", "localhost", "LOCALHOST",
                                  "gpu.localhost", "two words", "10.0.0.0/8"])
def test_a_loopback_or_malformed_address_is_refused(addr):
    with pytest.raises(ValidationError, match="node_addr"):
        Settings(node_addr=addr)


def test_none_given_or_an_empty_one_means_none_advertised():
    assert Settings().node_addr is None and Settings(node_addr=" ").node_addr is None


def test_the_command_names_a_refused_setting_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "trainyard", "worker", "--device", "cpu", "--burst"],
                       env={"PATH": "/usr/bin:/bin", "TRAINYARD_DATA_DIR": str(tmp_path),
                            "TRAINYARD_NODE_ADDR": "127.0.0.1"}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "TRAINYARD_NODE_ADDR: '127.0.0.1' is not an address another host can reach" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "trainyard.db").exists()
