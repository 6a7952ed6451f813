"""Device facts through NVML (nvidia-ml-py) and torch: name, arch, UUID, driver, memory, clocks, health.

The NVML layer is injectable (`nvml=` arguments) so that tests can fake a machine; production uses pynvml.
"""

from __future__ import annotations

from dataclasses import dataclass

from kdev.errors import EnvironmentMissing


def require_cuda(what: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise EnvironmentMissing(f"{what}: no CUDA GPU visible to torch")


def current_arch() -> str:
    """This GPU's arch (sm_NN); EnvironmentMissing in one line where torch sees no CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        from kdev.errors import EnvironmentMissing

        raise EnvironmentMissing("no CUDA GPU visible to torch")
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def load_nvml():
    """pynvml, initialised; None when NVML (or the driver) is not there."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


@dataclass
class GpuIdentity:
    index: int
    name: str
    arch: str
    uuid: str | None
    driver: str | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def current_gpu(nvml=None) -> GpuIdentity:
    """The GPU torch is using now, with NVML's UUID and driver when available."""
    import torch

    idx = torch.cuda.current_device()
    name = torch.cuda.get_device_name(idx)
    uuid = driver = None
    nvml = nvml or load_nvml()
    if nvml is not None:
        try:
            props = torch.cuda.get_device_properties(idx)
            pci = getattr(props, "pci_bus_id", None)
            h = None
            if pci is not None:
                bus = f"{getattr(props, 'pci_domain_id', 0):08x}:{pci:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
                try:
                    h = nvml.nvmlDeviceGetHandleByPciBusId(bus.encode())
                except Exception:
                    h = None
            h = h or nvml.nvmlDeviceGetHandleByIndex(idx)
            uuid = _s(nvml.nvmlDeviceGetUUID(h))
            driver = _s(nvml.nvmlSystemGetDriverVersion())
        except Exception:
            pass
    return GpuIdentity(index=idx, name=name, arch=current_arch(), uuid=uuid, driver=driver)


def sm_clock_mhz(nvml, handle) -> tuple[int, int] | None:
    """(current SM clock, max SM clock) in MHz, or None."""
    try:
        return (nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
                nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM))
    except Exception:
        return None


def throttle_reasons(nvml, handle) -> list[str]:
    """Active clock event reasons that slow the SM clock (thermal, power, ...), by name."""
    try:
        mask = nvml.nvmlDeviceGetCurrentClocksEventReasons(handle)
    except Exception:
        try:
            mask = nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
        except Exception:
            return []
    names = {
        "SwPowerCap": 0x4, "HwSlowdown": 0x8, "SyncBoost": 0x10, "SwThermalSlowdown": 0x20,
        "HwThermalSlowdown": 0x40, "HwPowerBrakeSlowdown": 0x80,
    }
    return [n for n, bit in names.items() if mask & bit]
