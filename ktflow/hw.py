"""Hardware profiles: what the cost model and placement know about a machine.

A profile is a pydantic model, so it is read from and written to JSON as it is. `resolve_hw`
accepts a profile object, a preset name, a path to a profile JSON, or None for this machine
(detected: CPU cores and memory; the GPU through torch.cuda when one is present). Bandwidth and
FLOP numbers of a detected machine are conservative defaults until `ktflow hw probe` (a later
issue) measures them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import ConfigError

GB = 1e9


class GpuSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    memory_bytes: float
    hbm_gbps: float
    bf16_tflops: float
    pcie_h2d_gbps: float
    pcie_d2h_gbps: float


class CpuSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    cores: int
    numa_nodes: int = 1
    memory_bytes: float
    dram_gbps: float  # per NUMA node, all cores reading
    gemm_tflops: float  # bf16 matrix throughput, all cores


class HwProfile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    cpu: CpuSpec
    gpus: list[GpuSpec] = []
    launch_overhead_us: float = 5.0  # one GPU kernel launch
    cpu_task_overhead_us: float = 2.0  # one CPU op dispatch

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)


PRESETS: dict[str, HwProfile] = {
    "cpu": HwProfile(name="cpu", cpu=CpuSpec(name="generic 16-core x86-64", cores=16, memory_bytes=128 * GB,
                                             dram_gbps=80, gemm_tflops=1.0)),
    "rtx4090-desktop": HwProfile(
        name="rtx4090-desktop",
        cpu=CpuSpec(name="single-socket 16-core desktop", cores=16, memory_bytes=192 * GB, dram_gbps=80,
                    gemm_tflops=1.0),
        gpus=[GpuSpec(name="RTX 4090", memory_bytes=24 * GB, hbm_gbps=1008, bf16_tflops=165,
                      pcie_h2d_gbps=25, pcie_d2h_gbps=25)]),
}


def this_machine() -> HwProfile:
    """A profile of the running machine from what the OS and torch report."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    mem = 16 * GB
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = float(line.split()[1]) * 1024
    except OSError:
        pass
    numa = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    cpu = CpuSpec(name=f"this machine ({cores} cores)", cores=cores, numa_nodes=numa, memory_bytes=mem,
                  dram_gbps=5.0 * cores, gemm_tflops=0.05 * cores)
    gpus = []
    try:
        import torch
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            gpus.append(GpuSpec(name=p.name, memory_bytes=float(p.total_memory), hbm_gbps=1000, bf16_tflops=100,
                                pcie_h2d_gbps=20, pcie_d2h_gbps=20))
    except Exception:
        pass
    return HwProfile(name="this", cpu=cpu, gpus=gpus)


def resolve_hw(hw: "HwProfile | str | os.PathLike | None") -> HwProfile:
    if hw is None or hw == "this":
        return this_machine()
    if isinstance(hw, HwProfile):
        return hw
    s = str(hw)
    if s in PRESETS:
        return PRESETS[s]
    p = Path(s)
    if p.suffix == ".json" or p.exists():
        try:
            return HwProfile.model_validate(json.loads(p.read_text()))
        except FileNotFoundError:
            raise ConfigError(f"hardware profile {p} does not exist") from None
        except (ValidationError, json.JSONDecodeError) as e:
            raise ConfigError(f"hardware profile {p} is not a valid profile: {e}") from None
    raise ConfigError(f"unknown hardware profile {s!r}; use a preset ({', '.join(PRESETS)}), 'this', "
                      "or a path to a profile JSON")
