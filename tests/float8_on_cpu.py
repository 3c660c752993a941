"""train.py with --float8 allowed on this CPU, for the tests: float8's matmul is computed on the CPU in
float32 from the float8 values and their scales, standing in for the GPU's, so that the conversion, the
checkpoints and the export of a float8 run are tested without a GPU. Torch's own CPU float8 matmul is not
used: on an AMX Xeon it took 8 s for a 1024 x 256 x 1024 product, 250 times float32's, and a run's six steps
outlasted the test's timeout. Only the machine check and that matmul are replaced (torchao must still
import); everything else is train.py as it runs.

    torchrun --standalone --nproc_per_node=1 tests/float8_on_cpu.py --model=tiny --float8=True ...
"""

import runpy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from run import options  # noqa: E402
from run.model.float8 import import_torchao  # noqa: E402

scaled_mm = torch._scaled_mm


def scaled_mm_in_float32(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, **kwargs):
    """torch._scaled_mm's result, (a * scale_a) @ (b * scale_b) + bias, for CPU tensors."""
    if a.device.type != "cpu" or scale_result is not None:
        return scaled_mm(a, b, scale_a, scale_b, bias, scale_result, out_dtype, **kwargs)
    out = (a.float() * scale_a) @ (b.float() * scale_b)
    return (out if bias is None else out + bias).to(out_dtype or a.dtype)


torch._scaled_mm = scaled_mm_in_float32
options.check_float8_available = import_torchao
runpy.run_path(str(REPO / "train.py"), run_name="__main__")
