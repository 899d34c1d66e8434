"""Finding the node's GPUs: NVML when the NVIDIA library is importable, or simulated devices.

``pynvml`` (from the ``nvidia-ml-py`` package) is optional: GPU nodes install it beside the
agent; a laptop or a test runs ``--simulate-gpus 2x80GiB`` instead.
"""

from __future__ import annotations

import importlib
import logging
import re
from dataclasses import replace
from typing import Any, Protocol

from agents.protocol.messages import GpuInfo

logger = logging.getLogger(__name__)

_SIM_SPEC = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+(?:\.\d+)?)\s*(GiB|GB|MiB|MB|G|M)?\s*$")
_MIB_PER: dict[str, float] = {"GIB": 1024, "GB": 1000**3 / 2**20, "G": 1024, "MIB": 1, "MB": 1}


class GpuSource(Protocol):
    def read(self) -> tuple[GpuInfo, ...]: ...


def parse_simulated(spec: str, node: str) -> tuple[GpuInfo, ...]:
    """``2x80GiB`` → two simulated 80 GiB devices; several groups may be joined by commas."""
    gpus: list[GpuInfo] = []
    for part in spec.split(","):
        match = _SIM_SPEC.match(part)
        if match is None:
            raise ValueError(f"--simulate-gpus {spec!r}: expected COUNTxSIZE like 2x80GiB")
        count, size, unit = int(match.group(1)), float(match.group(2)), match.group(3) or "GiB"
        if count < 1 or count > 64 or size <= 0:
            raise ValueError(f"--simulate-gpus {spec!r}: 1-64 devices of a positive size")
        mib = int(size * _MIB_PER[unit.upper()])
        for _ in range(count):
            index = len(gpus)
            gpus.append(
                GpuInfo(
                    index=index,
                    uuid=f"SIM-{node}-{index}",
                    model=f"Simulated GPU {mib // 1024} GiB" if mib >= 1024 else "Simulated GPU",
                    memory_total_mib=mib,
                )
            )
    return tuple(gpus)


class SimulatedGpus:
    def __init__(self, gpus: tuple[GpuInfo, ...]) -> None:
        self.gpus = gpus

    def read(self) -> tuple[GpuInfo, ...]:
        return self.gpus


class NvmlGpus:
    """Devices and their memory use as the driver reports them, read on every status."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        nvml.nvmlInit()
        self.count = int(nvml.nvmlDeviceGetCount())
        self.static: list[GpuInfo] = []
        for index in range(self.count):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            self.static.append(
                GpuInfo(
                    index=index,
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    model=_text(nvml.nvmlDeviceGetName(handle)),
                    memory_total_mib=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // 2**20,
                )
            )

    def read(self) -> tuple[GpuInfo, ...]:
        out = []
        for gpu in self.static:
            try:
                handle = self.nvml.nvmlDeviceGetHandleByIndex(gpu.index)
                used = int(self.nvml.nvmlDeviceGetMemoryInfo(handle).used) // 2**20
            except Exception as exc:  # a device that fell off the bus must not stop reports
                logger.warning("NVML: cannot read gpu %s: %s", gpu.index, exc)
                used = gpu.memory_used_mib
            out.append(replace(gpu, memory_used_mib=used))
        return tuple(out)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def discover(simulate: str | None, node: str, *, fallback: str | None = None) -> GpuSource:
    """Simulated devices when asked; else NVML when it is importable and finds a driver;
    else the ``fallback`` simulated devices if given (the embedded default: real GPUs when
    there are some, simulated ones otherwise); else no GPUs (a CPU node can still run
    ``sim`` and ``llamacpp`` shards)."""
    if simulate:
        return SimulatedGpus(parse_simulated(simulate, node))
    none = SimulatedGpus(parse_simulated(fallback, node) if fallback else ())
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError:
        logger.info("pynvml (nvidia-ml-py) is not installed: %d simulated GPU(s)", len(none.read()))
        return none
    try:
        source = NvmlGpus(nvml)
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        logger.warning("NVML could not start (%s): %d simulated GPU(s)", exc, len(none.read()))
        return none
    if source.count == 0:
        logger.info("NVML found no GPU: %d simulated GPU(s)", len(none.read()))
        return none
    logger.info("NVML found %d GPU(s)", source.count)
    return source
