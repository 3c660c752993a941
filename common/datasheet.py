"""The GPU datasheet: dense peak TFLOPS by precision, HBM bandwidth and memory of each GPU the project
knows. The benchmark's verdicts, train.py's MFU and --gpu's memory all read it here.
"""

# Vendor datasheet peaks per GPU, DENSE (the datasheets print tensor figures with 2:4 sparsity;
# these are half of those): TFLOPS, HBM bandwidth in GB/s and HBM capacity in GB as printed there
# (train.py --dry_run judges fit against it; an "80GB" H100 holds 80 GiB, so this errs on the safe
# side). Matched by substring of torch.cuda.get_device_name() in this order, so the more specific
# names come first ("GH200" contains "H200", "H100 PCIe" contains "H100"). Sources:
# docs/BENCHMARK_FEATURES.md.
HOPPER = {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp8": 1978.9}  # SXM, 700 W
HOPPER_NVL = {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp8": 1670.5}  # PCIe card, 350-400 W
AMPERE = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp8": None}
# fmt: off
DATASHEET = {
    "GB200": dict(fp32=80.0, tf32=1250.0, bf16=2500.0, fp8=5000.0, memory_GBps=8000.0, memory_GB=186.0),
    "B200": dict(fp32=75.0, tf32=1100.0, bf16=2250.0, fp8=4500.0, memory_GBps=7700.0, memory_GB=180.0),
    "GH200 144G": {**HOPPER, "memory_GBps": 4900.0, "memory_GB": 144.0},
    "GH200": {**HOPPER, "memory_GBps": 4000.0, "memory_GB": 96.0},
    "H200 NVL": {**HOPPER_NVL, "memory_GBps": 4800.0, "memory_GB": 141.0},
    "H200": {**HOPPER, "memory_GBps": 4800.0, "memory_GB": 141.0},
    "H100 NVL": {**HOPPER_NVL, "memory_GBps": 3900.0, "memory_GB": 94.0},
    "H100 PCIe": dict(fp32=51.0, tf32=378.0, bf16=756.0, fp8=1513.0, memory_GBps=2000.0, memory_GB=80.0),
    "H100": {**HOPPER, "memory_GBps": 3350.0, "memory_GB": 80.0},
    "A100-SXM4-80GB": {**AMPERE, "memory_GBps": 2039.0, "memory_GB": 80.0},
    "A100 80GB PCIe": {**AMPERE, "memory_GBps": 1935.0, "memory_GB": 80.0},
    "A100": {**AMPERE, "memory_GBps": 1555.0, "memory_GB": 40.0},
}
# fmt: on


def datasheet(device_name: str) -> dict | None:
    """Dense peaks for a GPU name: {"fp32", "tf32", "bf16", "fp8": TFLOPS or None, "memory_GBps",
    "memory_GB"}; None if unknown."""
    for name_part, peaks in DATASHEET.items():
        if name_part.lower() in device_name.lower():
            return dict(peaks)
    return None
