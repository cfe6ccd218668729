"""Device classes: what a device can hold and how fast it computes, for simulated devices (`devices: 8xH200,4xL40S`)
and for the planner. Speed is bf16 dense tensor throughput relative to the H200 (a DiT step is compute-bound at
the sizes served); memory is what the device has, in bytes; host_to_device is the bandwidth an offload pays.

Sources (NVIDIA's datasheets; "dense" is half the figure they print with 2:4 sparsity):
- H200 SXM: 141 GB HBM3e, 989 TFLOPS bf16 dense. Host-to-device 55 GB/s: measured on the H200 this project ran
  on (BENCHMARKS.md, GPU calibration).
- H100 SXM: 80 GB HBM3, 989 TFLOPS bf16 dense, but 3.35 TB/s of memory bandwidth against the H200's 4.8 TB/s:
  0.9 is an estimate of what that costs a DiT step (its attention and norms are partly bandwidth-bound).
  Host-to-device: PCIe Gen5 x16 as the H200's, 55 GB/s (an estimate: the H200's measurement).
- L40S: 48 GB GDDR6, 362 TFLOPS bf16 dense: 0.37. Host-to-device: PCIe Gen4 x16, 25 GB/s (an estimate).
- L4: 24 GB GDDR6, 121 TFLOPS bf16 dense: 0.12. Host-to-device: PCIe Gen4 x16, 25 GB/s (an estimate).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GB = 10**9


@dataclass(frozen=True)
class DeviceClass:
    name: str
    memory_bytes: int
    #: bf16 dense throughput relative to the H200
    speed: float
    #: bytes per second a copy from host memory to the device moves (an offload's cost)
    host_to_device: float
    #: which of the numbers above are estimates rather than datasheet figures or measurements
    estimated: tuple[str, ...] = ()


CLASSES: dict[str, DeviceClass] = {c.name: c for c in (
    DeviceClass("H200", 141 * GB, 1.0, 55 * GB),
    DeviceClass("H100", 80 * GB, 0.9, 55 * GB, estimated=("speed", "host_to_device")),
    DeviceClass("L40S", 48 * GB, 0.37, 25 * GB, estimated=("host_to_device",)),
    DeviceClass("L4", 24 * GB, 0.12, 25 * GB, estimated=("host_to_device",)),
)}

#: the `devices` setting's form: COUNTxCLASS, comma-separated
PATTERN = r"^$|^[1-9][0-9]*x[A-Za-z0-9]+(,[1-9][0-9]*x[A-Za-z0-9]+)*$"


class DeviceError(ValueError):
    pass


def parse_devices(spec: str) -> list[DeviceClass]:
    """`8xH200,4xL40S` -> the devices in order (index 0 first): eight H200s, then four L40Ss. Class names are
    matched without regard to case; an unknown one is refused, naming the known ones."""
    if not re.fullmatch(PATTERN, spec.strip()):
        raise DeviceError(f"devices {spec!r}: expected COUNTxCLASS[,COUNTxCLASS...], e.g. 8xH200,4xL40S")
    out: list[DeviceClass] = []
    by_lower = {name.lower(): c for name, c in CLASSES.items()}
    for part in filter(None, spec.strip().split(",")):
        count, _, name = part.partition("x")
        cls = by_lower.get(name.lower())
        if cls is None:
            raise DeviceError(f"devices {spec!r}: no device class {name!r}; known: {', '.join(CLASSES)}")
        out += [cls] * int(count)
    return out


def class_of(device_name: str) -> DeviceClass | None:
    """The class of a device as its instance names it (MemoryStats.device): a simulated device's class, or a GPU's
    name as torch gives it ("NVIDIA H100 80GB HBM3": a class name as one of its words); None when none matches
    (the CPU, another GPU)."""
    words = set(re.findall(r"[a-z0-9]+", device_name.lower()))
    return next((c for name, c in CLASSES.items() if name.lower() in words), None)
