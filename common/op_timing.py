"""The operations of a training step, as a dispatch mode records them on fake tensors (TensorMeta in place of
each tensor), and their time on a real device: each distinct operation replayed on tensors of its shapes,
dtypes and strides, warmed up, then timed in a sustained loop. The dry run times them on the machine it runs
on; the benchmark (checks/model_timing.py) on every GPU of the cluster, where the job will train."""

import dataclasses
import functools
import hashlib
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

# A timed operation's calls run in batches of BATCH_SECONDS, at least MIN_BATCHES of them and
# MIN_TIMED_SECONDS in all (at most MAX_BATCHES), after a call that warms it up.
BATCH_SECONDS = 0.002
MIN_BATCHES, MAX_BATCHES, MIN_TIMED_SECONDS = 5, 10, 0.01
MAX_CALLS = 4**6
# More than the last-level cache of a CPU (tens of MB) or a GPU's L2 (50 MB on an H100).
CACHE_BYTES = {"cpu": 128 << 20, "cuda": 256 << 20}
MAX_COPIES = 64
FIRST_TOUCH_BYTES, FIRST_TOUCH_SAMPLES = 64 << 20, 6
# A step traced on a CPU records CPU flash attention: what a GPU runs in its place is timed there instead.
CPU_ATTENTION = {"aten._scaled_dot_product_flash_attention_for_cpu.default": "forward",
                 "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": "backward"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    shape: tuple
    stride: tuple
    dtype: torch.dtype

    @staticmethod
    def of(value):
        """value's TensorMeta if it is a tensor, else value itself."""
        if isinstance(value, torch.Tensor):
            return TensorMeta(tuple(value.shape), tuple(value.stride()), value.dtype)
        return value

    @property
    def bytes(self):
        return math_prod(self.shape) * self.dtype.itemsize

    def materialize(self, device):
        """A tensor of this shape, stride and dtype: ones for floats (no NaN from a square root or a log, no
        denormals, and quick to write), zeros for integers (valid indices)."""
        size = sum((n - 1) * s for n, s in zip(self.shape, self.stride)) + 1 if all(self.shape) else 0
        fill = 1 if self.dtype.is_floating_point else 0
        return torch.full((size,), fill, dtype=self.dtype, device=device).as_strided(self.shape, self.stride)


def math_prod(values):
    result = 1
    for value in values:
        result *= value
    return result


def describe(args, kwargs):
    """Arguments as text, tensors by shape and dtype: what tells two calls of one operation apart."""

    def text(value):
        if isinstance(value, TensorMeta):
            return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
        return repr(value)

    return ", ".join(text(leaf) for leaf in tree_leaves((args, kwargs)))


def signature(name, args, kwargs):
    """A short key for an operation at its arguments: the op's name and a digest of what describe() says."""
    digest = hashlib.sha1(describe(args, kwargs).encode()).hexdigest()[:12]
    return f"{name} {digest}"


def resolve(name):
    """torch.ops' operation from its name, e.g. aten.mm.default."""
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def time_operation(name, args, kwargs, device):
    """Seconds of one call of the operation on tensors of its shapes on device, or None when it cannot be
    replayed alone (an argument it cannot be given, such as a process group). Calls run in a row (the
    device's own queue stays full, as in a step), as many as last BATCH_SECONDS, in batches of which the
    median counts: a step runs through the same interruptions and slow spells of a shared machine, and its
    time is a median too (the fastest batch made a CPU step's prediction 5-20% low). The calls take turns
    over copies of the arguments that together outgrow the caches, so that each reads its inputs from
    memory, as the step's operations do."""
    try:
        size = sum(leaf.bytes for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, TensorMeta))
        copies = min(MAX_COPIES, max(1, -(-CACHE_BYTES[device.type] // max(size, 1))))
        arguments = [tuple(tree_map(lambda v: materialize(v, device), x) for x in (args, kwargs))
                     for _ in range(copies)]  # fmt: skip
        replays = [replay(name, *copy, device) for copy in arguments]

        def batch(calls):
            synchronize(device)
            started = time.perf_counter()
            for call in range(calls):
                replays[call % copies]()
            synchronize(device)
            return time.perf_counter() - started

        batch(1)  # warm-up
        calls = 1
        while (seconds := batch(calls)) < BATCH_SECONDS and calls < MAX_CALLS:
            calls *= 4
        batches, spent = [seconds], seconds
        while len(batches) < MAX_BATCHES and (len(batches) < MIN_BATCHES or spent < MIN_TIMED_SECONDS):
            batches.append(batch(calls))
            spent += batches[-1]
        return statistics.median(batches) / calls
    except (RuntimeError, TypeError, ValueError, AttributeError, IndexError, NotImplementedError):
        return None


def replay(name, args, kwargs, device):
    """One call of the operation on these tensors, as the device runs it. A step traced on a CPU (fake tensors
    run the CPU's kernels) records CPU flash attention, which a GPU runs as its own attention, forward or
    backward alone; and layer norm's statistics in the input's dtype, which a GPU keeps in fp32."""
    if device.type == "cuda" and name in CPU_ATTENTION:
        backward = CPU_ATTENTION[name] == "backward"
        query, key, value = args[1:4] if backward else args[:3]
        causal = args[7] if backward else (args[4] if len(args) > 4 else kwargs.get("is_causal", False))
        attend = functools.partial(torch.nn.functional.scaled_dot_product_attention, is_causal=causal,
                                   attn_mask=kwargs.get("attn_mask"), scale=kwargs.get("scale"))  # fmt: skip
        if not backward:
            return lambda: attend(query, key, value)
        inputs = tuple(tensor.requires_grad_() for tensor in (query, key, value))
        with torch.enable_grad():
            out = attend(*inputs)
        return lambda: torch.autograd.grad(out, inputs, args[0], retain_graph=True)
    if device.type == "cuda" and name == "aten.native_layer_norm_backward.default":
        args = (*args[:3], args[3].float(), args[4].float(), *args[5:])
    op = resolve(name)
    return lambda: op(*args, **kwargs)


def materialize(value, device):
    if isinstance(value, TensorMeta):
        return value.materialize(device)
    if isinstance(value, torch.device):
        return device
    return value


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eager_overheads():
    """(framework, dispatch, first touch): this host's seconds per operation of an eager training step beyond
    the kernel (framework_seconds), of dispatching one small operation alone, and per byte of memory written
    for the first time. dispatch: what a replayed operation's own timing already holds of it. first touch:
    the pages the system maps and zeroes at a first write, which a training step pays again every step for
    the memory it gives back (glibc returns the top of its heap past a threshold) and a replayed operation,
    reusing its memory, does not. Each the median of its loops, as time_operation's."""
    ones, add = torch.ones(4), torch.ops.aten.add.Tensor
    dispatch, first_touch = [], []
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(1000):
            add(ones, ones)
        dispatch.append((time.perf_counter() - started) / 1000)
    # Past glibc's largest threshold for an allocation mapped on its own (32 MB): new pages every time.
    elements = FIRST_TOUCH_BYTES // 4
    held = torch.empty(elements)
    for _ in range(FIRST_TOUCH_SAMPLES):
        started = time.perf_counter()
        held.fill_(1.0)
        rewrite = time.perf_counter() - started
        started = time.perf_counter()
        torch.empty(elements).fill_(1.0)
        first_touch.append(max(0.0, time.perf_counter() - started - rewrite) / FIRST_TOUCH_BYTES)
    # A process's first new mapping is quicker than the rest (measured: 50 against 280 ps a byte): left out.
    return framework_seconds(), statistics.median(dispatch), statistics.median(first_touch[1:])


def framework_seconds():
    """Python, modules, autograd and the dispatcher: this host's seconds per operation of the forward and
    backward of a small model whose kernels cost next to nothing, over the operations the dispatcher sees
    (views among them, as in a recorded step). The median of three loops."""
    layers = [[torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8)] for _ in range(8)]
    model, inputs = torch.nn.Sequential(*sum(layers, [])), torch.ones(4, 8)

    def step():
        model(inputs).sum().backward()

    step()  # warm-up
    with OperationCount() as count:
        step()
    framework = []
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(20):
            step()
        framework.append((time.perf_counter() - started) / 20 / count.calls)
    return statistics.median(framework)


class OperationCount(TorchDispatchMode):
    """The operations the dispatcher sees, counted."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))
