"""Each GPU alone: matmul TFLOPS per precision on the fastest MAMF shape, HBM bandwidth, and nvidia-smi's
telemetry (clocks, temperature, power, ECC) while it works.
"""

import functools
import math
import subprocess

import torch

from checks.timing import GB, MiB, median_seconds, stream_bytes, sustained
from checks.world import World
from common.datasheet import datasheet

SMI_FIELDS = {
    "uuid": None,
    "clocks.sm": "sm_clock_MHz",
    "clocks.max.sm": "sm_clock_max_MHz",
    "clocks.mem": "memory_clock_MHz",
    "temperature.gpu": "temperature_C",
    "power.draw": "power_W",
    "ecc.errors.corrected.volatile.total": "ecc_corrected_errors",
    "ecc.errors.uncorrected.volatile.total": "ecc_uncorrected_errors",
    "pcie.link.gen.current": "pcie_gen",
    "pcie.link.width.current": "pcie_width",
    "pcie.link.width.max": "pcie_width_max",
}


def nvidia_smi(uuid: str) -> dict:
    """This GPU's clocks, temperature, ECC counts and PCIe link from one nvidia-smi call, if there is one."""
    command = ["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"]
    try:
        lines = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return {"nvidia_smi": f"not available ({type(error).__name__})"}
    for line in lines.splitlines():
        values = [value.strip() for value in line.split(",")]
        if values[0].removeprefix("GPU-") == uuid.removeprefix("GPU-"):
            keys = list(SMI_FIELDS.values())[1:]
            return {
                "telemetry": "nvidia-smi",
                **{key: as_number(value) for key, value in zip(keys, values[1:])},
            }
    return {"nvidia_smi": f"GPU {uuid} not listed"}


def as_number(text: str):
    try:
        value = float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"
    return int(value) if value.is_integer() else value


def gpu_telemetry(uuid: str) -> dict:
    """The nvidia-smi fields read through NVML where nvidia-ml-py is installed (milliseconds, so
    the reading falls inside the loop still running on the GPU), else from nvidia-smi."""
    try:
        import pynvml
    except ImportError:
        return nvidia_smi(uuid)
    try:
        pynvml.nvmlInit()
        # bytes: older nvidia-ml-py hands the argument to ctypes' c_char_p as it is
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid.removeprefix('GPU-')}".encode())
    except pynvml.NVMLError:
        return nvidia_smi(uuid)

    def read(query, *args):
        try:
            return query(handle, *args)
        except pynvml.NVMLError:
            return None  # not supported on this board (ECC on some PCIe cards)

    milliwatts = read(pynvml.nvmlDeviceGetPowerUsage)

    def ecc(error_type):
        return read(pynvml.nvmlDeviceGetTotalEccErrors, error_type, pynvml.NVML_VOLATILE_ECC)

    return {
        "telemetry": "NVML",
        "sm_clock_MHz": read(pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_SM),
        "sm_clock_max_MHz": read(pynvml.nvmlDeviceGetMaxClockInfo, pynvml.NVML_CLOCK_SM),
        "memory_clock_MHz": read(pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_MEM),
        "temperature_C": read(pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU),
        "power_W": None if milliwatts is None else milliwatts / 1000,
        "ecc_corrected_errors": ecc(pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
        "ecc_uncorrected_errors": ecc(pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        "pcie_gen": read(pynvml.nvmlDeviceGetCurrPcieLinkGeneration),
        "pcie_width": read(pynvml.nvmlDeviceGetCurrPcieLinkWidth),
        "pcie_width_max": read(pynvml.nvmlDeviceGetMaxPcieLinkWidth),
    }


# Matmul shapes (M, N, K) tried for each precision: the best shapes the MAMF finder found on A100,
# H100 and GH200 (its comparison table, docs/BENCHMARK_FEATURES.md), plus the square of
# --matmul_size. As the finder reports the best shape of its sweep, each is timed briefly and the
# fastest one runs the sustained loop; a full sweep would take hours.
MAMF_SHAPES = {
    "bf16": [(2048, 2048, 13312), (1024, 15360, 4096), (1024, 10240, 5120), (2048, 5120, 6144)],
    "fp8": [(1024, 9216, 14336), (1024, 14336, 14336)],
}
SHAPE_PROBE_REPEATS = 5
MATMUL_KINDS = ("fp32", "tf32", "bf16", "fp8")


def matmul_call(kind: str, shape: tuple, device):
    """A closure multiplying a random M x K by a K x N matrix in `kind` precision (inputs made once)."""
    m, n, k = shape
    if kind == "fp8":
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise NotImplementedError("fp8 needs compute capability 8.9 or later")
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # _scaled_mm wants column-major
        scale = torch.tensor(1.0, device=device)
        return lambda: torch._scaled_mm(a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    return lambda: torch.mm(a, b, out=out)


def fastest_shape(kind: str, shapes: list, device) -> tuple:
    """The shape whose median of a few calls gives the most FLOPS (each shape's matrices are freed
    before the next one's are made)."""

    def flops(shape):
        call = matmul_call(kind, shape, device)
        return 2 * math.prod(shape) / median_seconds(call, device, warmup=2, repeats=SHAPE_PROBE_REPEATS)

    return max(shapes, key=flops)


def gpu_section(world: World, cfg: dict) -> dict:
    if world.device.type != "cuda":
        return {"skipped": "no GPU present"}
    device = world.device
    props = torch.cuda.get_device_properties(device)
    result = {
        "name": props.name,
        "memory_GB": round(props.total_memory / GB, 1),
        "capability": f"{props.major}.{props.minor}",
    }
    timing = {
        "warmup_s": cfg["gpu_warmup_s"],
        "seconds": cfg["gpu_seconds"],
        "window_s": min(cfg["gpu_window_s"], cfg["gpu_seconds"] / 2),  # a first and a last window
    }
    numel = cfg["gpu_copy_MiB"] * MiB // 4
    source, target = torch.randn(numel, device=device), torch.empty(numel, device=device)
    loop = sustained(functools.partial(target.copy_, source), device, **timing)
    result["copy_GB/s"] = stream_bytes("copy", numel, itemsize=4) * loop["calls_per_s"] / GB
    result["copy_throttle_ratio"] = loop["throttle_ratio"]
    del source, target
    telemetry = {}

    def sample():  # while the bf16 loop, the one training lives on, still runs: clocks of a hot GPU
        telemetry.update(gpu_telemetry(str(props.uuid)))

    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for kind in MATMUL_KINDS:
            torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
            square = (cfg["matmul_size"],) * 3
            try:
                shape = fastest_shape(kind, [square] + MAMF_SHAPES.get(kind, MAMF_SHAPES["bf16"]), device)
                loop = sustained(
                    matmul_call(kind, shape, device),
                    device,
                    **timing,
                    while_busy=sample if kind == "bf16" else None,
                )
                result[f"matmul_{kind}_TFLOPS"] = 2 * math.prod(shape) * loop["calls_per_s"] / 1e12
                result[f"matmul_{kind}_throttle_ratio"] = loop["throttle_ratio"]
                result[f"matmul_{kind}_shape"] = "x".join(map(str, shape))
            except (NotImplementedError, RuntimeError) as error:
                result[f"matmul_{kind}_TFLOPS"] = None
                result[f"matmul_{kind}_note"] = f"not supported: {str(error).splitlines()[0]}"
            torch.cuda.empty_cache()  # the closure's matrices are gone; give their memory back
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    result["sustained_seconds"] = cfg["gpu_seconds"]
    peaks = datasheet(props.name) or {}
    figures = {"copy_GB/s": "memory_GBps", **{f"matmul_{k}_TFLOPS": k for k in MATMUL_KINDS}}
    for key, peak_key in figures.items():
        if peaks.get(peak_key) and result.get(key):
            result[f"{key.rsplit('_', 1)[0]}_percent_of_datasheet"] = 100 * result[key] / peaks[peak_key]
    result.update(telemetry or gpu_telemetry(str(props.uuid)))  # the bf16 loop failed: read it idle
    return result
