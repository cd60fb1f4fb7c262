"""The one chip table of hf_pretrain: memory per device and dense peak TFLOP/s per precision.

Telemetry (MFU against spec), the memory estimator (`hf-pretrain estimate-memory --device`), the
planner (`hf-pretrain plan --device`) and the benchmarks read a chip's facts here, through one
matching function, so a chip added once is known everywhere and the places cannot disagree.

- Peaks: dense (not 2:4-sparse) tensor-core TFLOP/s per GPU from the vendors' spec sheets, by
  precision column (`bf16`, `fp8`, `fp4`: a recipe's `spec_key`); where a sheet only quotes sparse
  figures they are halved. A precision missing from a chip's row has no peak (an A100 has no fp8
  tensor cores): callers report it unavailable, never a made-up 0.
- Memory: nvidia-smi's `memory.total` in MiB where known (an "80 GB" H100 shows 81559 MiB), else the
  nominal size. A chip sold in several sizes maps each size in GB to its MiB, the first one being
  the default when the name says no size. A chip without a memory figure has `memory_mib == {}`.
  No table here holds bandwidth: nothing in hf_pretrain prices a memory-bound step yet.

Matching (`match`): a table's keys are lower-case substrings of `torch.cuda.get_device_name()`,
most specific first, found at word boundaries ("l4" is not "l40s") in the name with `-` and `_`
read as spaces, so "NVIDIA A100-SXM4-40GB", "a100-40" and "H100" all resolve. The planner's own
per-chip assumptions (plan/hardware.py's recorded MFU) use the same function.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

V = TypeVar("V")


@dataclass(frozen=True)
class Chip:
    key: str  # the lower-case name substring it is matched by
    tflops: Mapping[str, float]  # precision column -> dense peak TFLOP/s per GPU
    memory_mib: Mapping[int, int] = field(default_factory=dict)  # size in GB -> MiB; first = default

    def memory_bytes(self, name: str = "") -> int | None:
        """The memory of the variant `name` names (e.g. "40GB"), else the default one; None when unknown."""
        if not self.memory_mib:
            return None
        sizes = [int(n) for n in re.findall(r"(?<![0-9])(\d+)\s*(?:gb|g)?(?![0-9])", normalise(name))]
        mib = next((self.memory_mib[n] for n in sizes if n in self.memory_mib), next(iter(self.memory_mib.values())))
        return mib * 1024**2


def _chip(key: str, bf16: float, fp8: float | None = None, fp4: float | None = None, **memory_mib: int) -> Chip:
    peaks = {k: v for k, v in (("bf16", bf16), ("fp8", fp8), ("fp4", fp4)) if v is not None}
    return Chip(key, peaks, {int(size.removeprefix("gb")): mib for size, mib in memory_mib.items()})


# Most specific first. Memory keywords: gbNN=MiB for the NN GB variant.
CHIPS: tuple[Chip, ...] = (
    _chip("gb200", 2500.0, 5000.0, 10000.0, gb186=189_471),  # nominal 186 GB HBM3e per GPU
    _chip("b200", 2250.0, 4500.0, 9000.0, gb180=183_359),
    _chip("gb10", 125.0, 250.0, 500.0, gb128=131_072),  # DGX Spark: ~125 dense bf16 (field notes); unified memory
    _chip("dgx spark", 125.0, 250.0, 500.0, gb128=131_072),
    _chip("h200 nvl", 835.5, 1671.0, gb141=143_771),
    _chip("h200", 989.4, 1978.9, gb141=143_771),
    _chip("h100 nvl", 835.5, 1671.0, gb94=95_830),
    _chip("h100 pcie", 756.5, 1513.0, gb80=81_559, gb94=95_830),
    _chip("h100", 989.4, 1978.9, gb80=81_559, gb94=95_830),  # SXM
    _chip("h800 pcie", 756.5, 1513.0),
    _chip("h800", 989.4, 1978.9),
    _chip("a100", 312.0, gb80=81_920, gb40=40_960),
    _chip("a800", 312.0),
    _chip("l40s", 362.1, 733.0, gb48=46_068),
    _chip("l40", 181.0, 362.0, gb48=46_068),
    _chip("l4", 121.0, 242.5, gb24=23_034),
    _chip("rtx 5090", 209.5, 419.0, 838.0, gb32=32_607),
    _chip("rtx 4090", 165.2, 330.3, gb24=24_564),
    _chip("mi300x", 1307.4, 2614.9, gb192=196_608),
)
_BY_KEY = {chip.key: chip for chip in CHIPS}


def normalise(name: str) -> str:
    return re.sub(r"[-_]", " ", name.lower())


def match(name: str, table: Mapping[str, V]) -> V | None:
    """The value of the first key of `table` found in the device `name` (word boundaries), or None."""
    lowered = normalise(name)
    for key, value in table.items():
        if re.search(rf"(?<![a-z0-9]){re.escape(key)}(?![a-z0-9])", lowered):  # "l4" is not "l40s"
            return value
    return None


def find_chip(name: str) -> Chip | None:
    """The chip a device name (`torch.cuda.get_device_name()`, or "h100", "a100-40") resolves to, or None."""
    return match(name, _BY_KEY)


def spec_tflops(name: str, precision: str) -> float | None:
    """Dense spec peak for a device name and precision column, or None when the chip or precision is unknown."""
    chip = find_chip(name)
    return chip.tflops.get(precision) if chip else None


def device_memory_bytes(name: str) -> int | None:
    """Memory of a device named like `torch.cuda.get_device_name()` or `h100`, `a100-40`; None when unknown."""
    chip = find_chip(name)
    return chip.memory_bytes(name) if chip else None


def known_chips(fact: str = "any") -> list[str]:
    """Sorted keys of the chips with a `memory` figure, a `peak`, or `any`: for error messages and `--help`."""
    keep = {"any": lambda c: True, "memory": lambda c: bool(c.memory_mib), "peak": lambda c: bool(c.tflops)}[fact]
    return sorted(chip.key for chip in CHIPS if keep(chip))
