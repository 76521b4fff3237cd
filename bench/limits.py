"""What small hostile requests cost the service: each of issue 8's probes sent to a live server, with
the server's peak memory (VmHWM from /proc), the bytes stored and the time measured.

    .venv/bin/python -m bench.limits            # this checkout
    cp bench/limits.py bench/common.py OLD/bench/ && (cd OLD && python -m bench.limits)   # an older checkout

Run as root (VmHWM is reset through /proc/<pid>/clear_refs). Probes that a checkout refuses are
fast; on a checkout without the bounds some take minutes and gigabytes (the 10 GB FakeData cache
is not sent: it is the same whatever the checkout, and a test covers its eviction). The older checkout
needs trainyard.app.launcher (bench/common.py starts the service with it).
"""
import io
import json
import struct
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from bench.common import service
from trainyard.app.launcher import Service

# A 1,000-class model is over the default parameter bound; the probes measure the uploads, not that bound.
LIMITS_ENV = {"TRAINYARD_MAX_PARAMETERS": str(10**10)}

MiB = 1 << 20


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def csv_long_label(rows: int) -> bytes:
    body = "a,b,label\n" + "1,2,x\n" * rows + "3,4," + "y" * 131_000 + "\n"
    return body.encode()


def csv_wide(columns: int) -> bytes:
    header = ",".join(f"c{i}" for i in range(columns)) + ",label\n"
    return (header + ",".join("1" for _ in range(columns)) + ",x\n").encode()


def npz_zeros() -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, x=np.zeros((264_000, 32, 32), dtype=np.uint8), y=np.arange(264_000) % 2)
    return buf.getvalue()


def zip_inflating(member_bytes: int) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        with zf.open("a/zeros.png", "w", force_zip64=True) as m:
            for _ in range(member_bytes // MiB):
                m.write(b"\0" * MiB)
        for i in range(11):  # enough samples that decoding begins
            zf.writestr(f"b/{i}.png", b"\0")
    return buf.getvalue()


def zip_entries(n: int) -> bytes:
    """A zip whose central directory has n entries: written once, its records repeated (fast)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("a/0.png", b"")
    raw = buf.getvalue()
    cd_at = struct.unpack("<I", raw[-6:-2])[0]
    local, entry = raw[:cd_at], raw[cd_at:-22]
    cd = entry * n
    eocd = b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    z64 = b"PK\x06\x06" + struct.pack("<QHHIIQQQQ", 44, 45, 45, 0, 0, n, n, len(cd), len(local))
    locator = b"PK\x06\x07" + struct.pack("<IQI", 0, len(local) + len(cd), 1)
    return local + cd + z64 + locator + eocd


def upload(svc: Service, c: httpx.Client, name: str, content: bytes, **form: str) -> dict:
    pid = server_pid(svc)
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    base, before, t0 = peak_rss(pid), disk(svc.data_dir / "datasets"), time.perf_counter()
    r = c.post("/datasets", files={"file": (name, content)}, data=form, timeout=900)
    return {"status": r.status_code, "seconds": time.perf_counter() - t0,
            "server_peak_growth_mb": (peak_rss(pid) - base) / MiB,
            "stored_mb": (disk(svc.data_dir / "datasets") - before) / MiB, "request_kb": len(content) / 1024,
            "detail": r.text[:160]}


def server_pid(svc: Service) -> int:
    assert svc.server is not None, "the service's server is not started"
    return svc.server.pid


def predict_rows(svc: Service, c: httpx.Client) -> dict:
    """Issue 8 #1: 5,000 rows against a 1,000-class model, then the reads the dashboard makes."""
    job = svc.submit({"kind": "train", "model": {"arch": "mlp", "hidden": [8], "num_classes": 1000},
                      "data": {"dataset": "iris"}, "train": {"epochs": 2}, "device": "cpu"})
    svc.wait_state(job["id"])
    body = {"kind": "predict", "model_job": job["id"], "inputs": [[5.1, 3.5, 1.4, 0.2]] * 5000}
    r = c.post("/jobs", json=body)
    out = {"status": r.status_code, "request_kb": len(json.dumps(body)) / 1024, "detail": r.text[:160]}
    if r.status_code == 201:
        svc.wait_state(r.json()["id"], timeout=900)
    pid = server_pid(svc)
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    base, t0 = peak_rss(pid), time.perf_counter()
    for path in ("/jobs?limit=50", f"/jobs/{r.json().get('id', job['id'])}", "/metrics", "/healthz"):
        c.get(path, timeout=120)
    return {**out, "reads_seconds": time.perf_counter() - t0, "server_peak_growth_mb": (peak_rss(pid) - base) / MiB}


PROBES: dict[str, Callable[[Service, httpx.Client], dict]] = {
    "#2 CSV, one 131k-char label": lambda s, c: upload(s, c, "l.csv", csv_long_label(3000), label_column="label"),
    "#4 CSV, 100k columns": lambda s, c: upload(s, c, "w.csv", csv_wide(100_000), label_column="label"),
    "#3 npz of zero uint8 images": lambda s, c: upload(s, c, "z.npz", npz_zeros()),
    "#5 zip, a member inflating to 1 GiB": lambda s, c: upload(s, c, "b.zip", zip_inflating((1 << 30) - MiB)),
    "#5 zip, a million entries": lambda s, c: upload(s, c, "m.zip", zip_entries(1_000_000)),
    "#1 predict 5,000 rows x 1,000 classes": predict_rows,
}


def main() -> None:
    rows = []
    for name, probe in PROBES.items():
        if len(sys.argv) > 1 and sys.argv[1] not in name:
            continue
        with service(workers=1, env=LIMITS_ENV) as svc, svc.client() as c:
            rows.append((name, probe(svc, c)))
        print(name, json.dumps(rows[-1][1]), flush=True)
    print("\n| probe | request KB | status | seconds | server peak growth MB | stored MB |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows:
        secs = r.get("seconds", r.get("reads_seconds", 0))
        print(f"| {name} | {r['request_kb']:,.0f} | {r['status']} | {secs:.2f} | {r['server_peak_growth_mb']:,.0f} | "
              f"{r.get('stored_mb', 0):,.1f} |")


if __name__ == "__main__":
    main()
