"""A straggler for tests/test_diagnose.py: in the training process of local rank SLOW_RANK, each decoder
layer's forward takes SLOW_LAYER_S seconds longer, as on a throttled node. Python imports this file as it
starts wherever this folder is in PYTHONPATH. The sleep comes last in the layer's call, inside the window
that the run's own timing hooks measure (the global hooks run before the module's), and holds however busy
the machine is: a throttle from outside (SIGSTOP and SIGCONT) left a layer's forward unslowed at times."""

import os

if os.environ.get("SLOW_RANK") is not None and os.environ.get("LOCAL_RANK") == os.environ["SLOW_RANK"]:
    import time

    import torch

    def _slower(module, args, output):
        if any(kind.__name__ == "GPT2Block" for kind in type(module).__mro__):  # FSDP2 subclasses it
            time.sleep(float(os.environ["SLOW_LAYER_S"]))

    torch.nn.modules.module.register_module_forward_hook(_slower)
