"""The one chip table of hf_pretrain: memory per device, dense peak TFLOP/s per precision, and the link between
GPUs of a node.

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
  No table here holds memory bandwidth: nothing in hf_pretrain prices a memory-bound step yet.
- Link (`link_gbps`): what one GPU can send to the other GPUs of its node, GB/s (1e9 bytes) *each way* - the
  vendors quote NVLink both ways added (H100 SXM "900 GB/s" = 18 links x 25 GB/s x 2 directions), so the table
  holds half of that: NVLink 5 (B200, GB200) 900, NVLink 4 (H100, H200 SXM) 450, H800's cut NVLink 200,
  NVLink 3 (A100 SXM) 300, A800's 200; PCIe 5 x16 64, PCIe 4 x16 32 for cards without NVLink in every pair
  (PCIe, NVL bridges join only 2 or 4 cards). The planner prices sequence parallelism's all-to-all with it.
  `None` where no figure applies: one GPU per box with unified memory (GB10), or a mesh whose bandwidth depends
  on how many peers an all-to-all reaches (MI300X: 64 GB/s each way to each of 7 peers) - unavailable, never 0.
  The network *between* nodes is not here: it is the cluster's, not the chip's (`hf-pretrain plan --network-gbps`,
  GB/s each way per GPU).

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
    link_gbps: float | None = None  # one GPU to the rest of its node, GB/s each way; None: unavailable

    def memory_bytes(self, name: str = "") -> int | None:
        """The memory of the variant `name` names (e.g. "40GB"), else the default one; None when unknown."""
        if not self.memory_mib:
            return None
        sizes = [int(n) for n in re.findall(r"(?<![0-9])(\d+)\s*(?:gb|g)?(?![0-9])", normalise(name))]
        mib = next((self.memory_mib[n] for n in sizes if n in self.memory_mib), next(iter(self.memory_mib.values())))
        return mib * 1024**2


def _chip(
    key: str,
    bf16: float,
    fp8: float | None = None,
    fp4: float | None = None,
    link: float | None = None,
    **memory_mib: int,
) -> Chip:
    peaks = {k: v for k, v in (("bf16", bf16), ("fp8", fp8), ("fp4", fp4)) if v is not None}
    return Chip(key, peaks, {int(size.removeprefix("gb")): mib for size, mib in memory_mib.items()}, link)


# Links, GB/s each way (the module docstring): the vendors' spec sheets, both directions halved.
NVLINK5, NVLINK4, NVLINK3 = 900.0, 450.0, 300.0  # B200/GB200 1.8 TB/s; H100/H200 SXM 900 GB/s; A100 SXM 600 GB/s
NVLINK_CUT = 200.0  # H800 and A800 SXM: 400 GB/s (export versions)
PCIE5, PCIE4 = 64.0, 32.0  # x16: 128 and 64 GB/s both ways


# Most specific first. Memory keywords: gbNN=MiB for the NN GB variant.
CHIPS: tuple[Chip, ...] = (
    _chip("gb200", 2500.0, 5000.0, 10000.0, NVLINK5, gb186=189_471),  # nominal 186 GB HBM3e per GPU
    _chip("b200", 2250.0, 4500.0, 9000.0, NVLINK5, gb180=183_359),
    _chip("gb10", 125.0, 250.0, 500.0, gb128=131_072),  # DGX Spark: ~125 dense bf16 (field notes); unified memory
    _chip("dgx spark", 125.0, 250.0, 500.0, gb128=131_072),
    _chip("h200 nvl", 835.5, 1671.0, link=PCIE5, gb141=143_771),
    _chip("h200", 989.4, 1978.9, link=NVLINK4, gb141=143_771),
    _chip("h100 nvl", 835.5, 1671.0, link=PCIE5, gb94=95_830),
    _chip("h100 pcie", 756.5, 1513.0, link=PCIE5, gb80=81_559, gb94=95_830),
    _chip("h100", 989.4, 1978.9, link=NVLINK4, gb80=81_559, gb94=95_830),  # SXM
    _chip("h800 pcie", 756.5, 1513.0, link=PCIE5),
    _chip("h800", 989.4, 1978.9, link=NVLINK_CUT),
    _chip("a100 pcie", 312.0, link=PCIE4, gb80=81_920, gb40=40_960),
    _chip("a100", 312.0, link=NVLINK3, gb80=81_920, gb40=40_960),  # SXM
    _chip("a800", 312.0, link=NVLINK_CUT),
    _chip("l40s", 362.1, 733.0, link=PCIE4, gb48=46_068),
    _chip("l40", 181.0, 362.0, link=PCIE4, gb48=46_068),
    _chip("l4", 121.0, 242.5, link=PCIE4, gb24=23_034),
    _chip("rtx 5090", 209.5, 419.0, 838.0, PCIE5, gb32=32_607),
    _chip("rtx 4090", 165.2, 330.3, link=PCIE4, gb24=24_564),
    _chip("mi300x", 1307.4, 2614.9, gb192=196_608),  # Infinity Fabric mesh: per peer, not per GPU (docstring)
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


def link_gbps(name: str) -> float | None:
    """One GPU's link to the rest of its node, GB/s each way; None when the chip or its figure is unknown."""
    chip = find_chip(name)
    return chip.link_gbps if chip else None


def known_chips(fact: str = "any") -> list[str]:
    """Sorted keys of the chips with a `memory` figure, a `peak`, a `link`, or `any`: for messages and `--help`."""
    keep = {
        "any": lambda c: True,
        "memory": lambda c: bool(c.memory_mib),
        "peak": lambda c: bool(c.tflops),
        "link": lambda c: c.link_gbps is not None,
    }[fact]
    return sorted(chip.key for chip in CHIPS if keep(chip))
