"""The README's curl walk-through, run as written against a live server and worker."""
import json
import re
import subprocess
import sys

from tests.service import ROOT
import pytest

pytestmark = pytest.mark.slow  # starts the real server and workers


def walkthrough_blocks() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Walk-through with curl", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(sh|python)\n(.*?)```", section, re.S)


def test_readme_walkthrough(service, tmp_path):
    service.start_worker("cpu")
    host = service.url.removeprefix("http://")
    outputs = []
    for lang, code in walkthrough_blocks():
        code = code.replace("localhost:8000", host)
        if lang == "sh":
            if "/result" in code:  # "a moment later"
                for job_id in (2, 3):
                    assert service.wait_state(job_id)["state"] == "succeeded"
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, capture_output=True,
                               text=True, timeout=60)
        else:
            r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                               timeout=60)
        assert r.returncode == 0, (code, r.stderr)
        outputs.append(r.stdout)
        if '"name": "iris-mlp"' in code:
            submitted = json.loads(r.stdout)
            assert submitted["id"] == 1 and submitted["state"] == "queued"
            assert service.wait_state(1)["state"] == "succeeded"
    assert len(outputs) == 7
    status, _ = json.JSONDecoder().raw_decode(outputs[1])  # curl prints the documents back to back
    assert status["progress"] == {"epoch": 100, "epochs": 100} and status["result"]["val_accuracy"] >= 0.9
    assert (tmp_path / "iris.safetensors").stat().st_size > 0 and (tmp_path / "iris.pt").stat().st_size > 0
    assert '"class":"setosa"' in outputs[5].replace(" ", "")
    assert '"accuracy"' in outputs[5] and '"confusion_matrix"' in outputs[5]
    # The Python client: the same service, the same model.
    assert outputs[6].strip() == "virginica"
    assert (tmp_path / "iris-again.safetensors").read_bytes() == (tmp_path / "iris.safetensors").read_bytes()
