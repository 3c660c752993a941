"""train.py with --float8 allowed on this CPU, for the tests: torch's CPU float8 matmul stands in for the
GPU's, so that the conversion, the checkpoints and the export of a float8 run are tested without a GPU.
Only the machine check is replaced (torchao must still import); everything else is train.py as it runs.

    torchrun --standalone --nproc_per_node=1 tests/float8_on_cpu.py --model=tiny --float8=True ...
"""

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from run import options  # noqa: E402
from run.model.float8 import import_torchao  # noqa: E402

options.check_float8_available = import_torchao
runpy.run_path(str(REPO / "train.py"), run_name="__main__")
