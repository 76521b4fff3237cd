"""Which GPU a CUDA device number is: torch's cuda:N matched to NVML's list of GPUs, by UUID (from the
worker's warm-up child) or by parsing CUDA_VISIBLE_DEVICES as CUDA does."""
import os
import re

from trainyard.app.fleet import nvml


def bare_uuid(uuid: str | None) -> str | None:
    """A GPU's UUID without NVML's `GPU-`/`MIG-` prefix, as torch's device properties give it."""
    if uuid is None:
        return None
    u = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        u = u.removeprefix(prefix)
    return u


def _strtoul(s: str) -> int:
    """The number an entry of CUDA_VISIBLE_DEVICES starts with (`1gpu` is 1), -1 for none."""
    m = re.match(r"[+-]?\d+", s)
    return int(m.group()) if m else -1


def visible_indices(gpus: int | list[dict], env: str | None = None) -> list[int]:
    """Map CUDA's device numbers (torch's cuda:N) to positions in NVML's list of GPUs (nvml_devices(), or a
    count of whole cards), honouring CUDA_VISIBLE_DEVICES as CUDA and torch parse it: integers (cards
    in PCI bus order, the order CUDA_DEVICE_ORDER=PCI_BUS_ID gives them), `GPU-<uuid>` or a unique
    prefix of one, `MIG-<uuid>`. The first entry's form decides the list's; parsing stops at the first
    entry that names no device, and a device named twice empties the list."""
    if isinstance(gpus, int):
        gpus = [{"nvml_index": i, "uuid": None, "mig_parent": None} for i in range(gpus)]
    env = os.environ.get("CUDA_VISIBLE_DEVICES") if env is None else env
    if env is None:
        return list(range(len(gpus)))
    entries = [e.strip() for e in env.split(",")]
    out: list[int] = []
    form = "GPU-" if env.startswith("GPU-") else "MIG-" if env.startswith("MIG-") else None
    for entry in entries:
        if form is None:
            n = _strtoul(entry)
            found = next((p for p, g in enumerate(gpus) if g.get("nvml_index") == n), None) if n >= 0 else None
        elif not entry.startswith(form):
            found = None
        else:
            mig = form == "MIG-"
            matches = [p for p, g in enumerate(gpus) if (g.get("uuid") or "").startswith(entry)
                       and bool(g.get("mig_parent")) == mig]
            found = matches[0] if len(matches) == 1 else None  # an ambiguous prefix names no device
        if found is None:
            break
        if found in out:
            return []
        out.append(found)
    return out


def is_device_uuid(key: str | None) -> bool:
    """A GPU's or MIG instance's UUID as NVML writes it (what CUDA_VISIBLE_DEVICES accepts)."""
    return isinstance(key, str) and key.startswith(("GPU-", "MIG-"))


def torch_order(gpus: list[dict], torch_uuids: list[str | None]) -> list[int | None]:
    """Positions in NVML's list of the GPUs torch numbers cuda:0, cuda:1 ..., matched by UUID (what the
    worker's warm-up child read of each: torch.cuda.get_device_properties(i).uuid); None for a device
    NVML does not list. By UUID, not by index: the two may count cards in different orders."""
    by_uuid = {bare_uuid(g.get("uuid")): p for p, g in enumerate(gpus) if g.get("uuid")}
    return [by_uuid.get(bare_uuid(u)) if u else None for u in torch_uuids]


def visible_cuda_count() -> int:
    nv = nvml.nvml_devices()
    return len(visible_indices(nv)) if nv else 0


def visible_uuids(gpus: list[dict], env: str | None = None) -> list[str]:
    """What CUDA_VISIBLE_DEVICES to give each of this host's workers, one per device CUDA may use here (honouring
    a CUDA_VISIBLE_DEVICES already set, as visible_indices does): the UUID NVML gives each card, or each MIG
    instance of a card in MIG mode (CUDA reaches an instance through that variable only, one per process).
    An entry NVML could not read goes by its index: its worker then registers unavailable, saying why."""
    return [gpus[p].get("uuid") or str(gpus[p]["nvml_index"]) for p in visible_indices(gpus, env)]


def main(argv: list[str] | None = None) -> int:
    """Print visible_uuids() of this host, space-separated (the image's entrypoint starts a worker per word).
    --readings FILE lists recorded NVML readings instead: {"driver_version": ..., "cards": [each card as
    nvml._read_card reads it, a MIG-mode card with its "mig" list, or {"error": text} for one NVML fails on]}."""
    import argparse
    import json
    p = argparse.ArgumentParser(prog="python -m trainyard.app.fleet.gpu_order", description=main.__doc__)
    p.add_argument("--readings", metavar="FILE")
    args = p.parse_args(argv)
    if args.readings:
        with open(args.readings) as f:
            recorded = json.load(f)
        cards = recorded["cards"]

        def read(i: int) -> dict:
            if "error" in cards[i]:
                raise RuntimeError(cards[i]["error"])
            return dict(cards[i])
        gpus: list[dict] | None = nvml.gpu_entries(len(cards), read, recorded.get("driver_version"))
    else:
        gpus = nvml.nvml_devices()
    print(" ".join(visible_uuids(gpus or [])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
