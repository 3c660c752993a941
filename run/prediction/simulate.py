"""The step on fake tensors: the real model, wrapping and training step at the target world size over a fake
process group, with no device and no memory, for what cannot be measured here: a rank's peak memory
(FSDPMemTracker) and the work of every operation and collective one rank issues (Recorder), which the
roofline costs. A compiled block goes through inductor's graph capture, decompositions and partition of what
backward saves, its graphs then run one operation at a time: the tracker sees what a compiled step keeps."""

import copy
import dataclasses
import functools
import itertools
import types
import unittest.mock

import torch
import torch.distributed as dist
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from common.nccl_tests import SWEEP_NAMES
from run.launch import device_mesh
from run.model.build import build_model
from run.model.step import build_optimizer, train_step
from run.stops import StopRequests

# The tracker's categories, in the words of the dry run's report.
MEMORY_CATEGORIES = {
    "sharded parameters": ("Sharded Param", "Parameter", "Buffer"),
    "gathered parameters": ("Unsharded Param", "All Gather"),
    "gradients": ("Sharded Grad", "Unsharded Grad", "Reduce Scatter", "Gradient"),
    "optimizer state": ("OptState", "Optstate"),
    "activations": ("Activation", "Inputs"),
    "temporaries": ("Temp", "Other"),
}
OFFLOADED = ("sharded parameters", "gradients", "optimizer state")

DDP_ESTIMATE = ("estimated for DDP: FSDP simulated at world size 1 (every rank holds the whole model, as DDP "
                "does), plus DDP's gradient buckets, 4 bytes a parameter")  # fmt: skip
OFFLOAD_ESTIMATE = ("estimated for cpu_offload: the simulation without offloading, less the sharded "
                    "parameters, gradients and optimizer state, which offloading keeps in host "
                    "memory")  # fmt: skip
BLIND_SPOTS = ("allocator fragmentation, NCCL buffers and the CUDA context (leave a few GB); CPU flash "
               "attention stands in for the GPU's (both keep the same tensors); a compiled block's kernels "
               "are run one operation at a time, so its temporaries inside a kernel are counted")  # fmt: skip
# Operations that compute nothing: allocations, the profiler's marks, waits (and every view: is_view).
FREE = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
        "prim.device.default", "aten.lift_fresh.default", "profiler._record_function_enter_new.default",
        "profiler._record_function_exit._RecordFunction", "_c10d_functional.wait_tensor.default"}  # fmt: skip
# gloo's collectives, and the argument whose size the buffer each takes has (Tracker)
GLOO_BUFFERS = {"c10d._allgather_base_.default": 0, "c10d._reduce_scatter_base_.default": 1}
# The experts' grouped matmul (M x K by experts x K x N), as transformers runs it: aten's, or in float32
# on fake tensors (whose shape rule for aten's takes bf16 alone) its own operator of the same tensors.
EXPERTS = ("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default",
           "transformers.grouped_mm_fallback_backward.default")  # fmt: skip
# CPU flash attention is not in the FLOP counter's registry; its CUDA twin has the same shapes.
CPU_ATTENTION = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": sdpa_flop_count,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": sdpa_backward_flop_count,
}


class Tracker(FSDPMemTracker):
    """FSDPMemTracker that sees a compiled block's graphs run (ignoring the compiler's internals, else the
    block runs eager), and on a CPU run the buffers gloo's collectives take beside FSDP's: an all-gather one
    of its output's size, a reduce-scatter a copy of its input, until the next one of its kind or the
    optimizer (the profiler's memory events, tests/perf/bench_memory.py). Without them a 2-process CPU run's
    peak was simulated 3-9% under the real one."""

    def __init__(self, model, optimizer, gloo):
        super().__init__(model, optimizer)
        self.gloo, self.buffers = gloo, {}

    ignore_compile_internals = classmethod(lambda cls: True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.gloo and self._in_opt:
            self.buffers.clear()
        buffer_of = GLOO_BUFFERS.get(str(func)) if self.gloo else None
        if buffer_of is not None:  # the previous one of its kind has completed: FSDP waited for it
            self.buffers.pop(str(func), None)
            empty_like = torch.ops.aten.empty_like.default
            self.buffers[str(func)] = super().__torch_dispatch__(empty_like, types, (args[buffer_of],), {})
        return super().__torch_dispatch__(func, types, args, kwargs)


@dataclasses.dataclass
class Operation:
    """One operation or collective of the step, as one rank issues it, with what a roofline needs."""

    flops: float
    dtype: torch.dtype | None  # of its first floating-point input: which matmul rate applies
    collective: tuple | None = None  # (nccl-tests name, bytes as nccl-tests sizes them, group size, nodes)
    backward: bool = False  # inside autograd's backward: the micro-steps end with the last such operation


class Recorder(TorchDispatchMode):
    """Every operation one rank runs, compiled graphs' included, below DTensor (which decomposes first into
    the local operations and collectives a rank really runs)."""

    def __init__(self, ranks_per_node):
        super().__init__()
        self.operations, self.ranks_per_node = [], ranks_per_node

    ignore_compile_internals = classmethod(lambda cls: True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if str(func) in FREE or is_view(func):
            return out
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        dtype = next((tensor.dtype for tensor in tensors if tensor.dtype.is_floating_point), None)
        collective = self.collective(func, args, tensors)
        in_backward = torch._C._current_graph_task_id() != -1
        self.operations.append(Operation(flops(func, args, kwargs, out), dtype, collective, in_backward))
        return out

    def collective(self, func, args, tensors):
        name = str(func).replace("_", "")  # c10d's say allgather, functional ones all_gather, and so on
        kind = next((kind for kind in SWEEP_NAMES.values() if kind.replace("_", "") in name), None)
        if kind is None or not name.startswith(("c10d.", "c10dfunctional.")):
            return None
        boxed = next((leaf for leaf in tree_leaves(args) if isinstance(leaf, torch.ScriptObject)), None)
        if boxed is not None:  # c10d's own operations take the group itself; functional ones its name
            group = dist.ProcessGroup.unbox(boxed)
        else:
            group = dist.distributed_c10d._resolve_process_group(args[-1])
        ranks = dist.get_process_group_ranks(group)
        nodes = len({rank // self.ranks_per_node for rank in ranks})
        # nccl-tests' sizes: an all-gather's output, a reduce-scatter's input, an all-reduce's tensors
        sizes = [t.numel() * t.element_size() for t in tensors]
        moved = sum(sizes) if kind == "all_reduce" else max(sizes, default=0)
        return kind, moved, len(ranks), nodes


@functools.cache
def is_view(func):
    """Whether every output of the operation is a view of an input."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def flops(func, args, kwargs, out):
    """FLOPs as torch's FLOP counter counts them."""
    if str(func) in CPU_ATTENTION:  # forward: query, key and value; backward: the gradient first
        shapes = [tuple(leaf.shape) for leaf in args[:4] if isinstance(leaf, torch.Tensor)]
        return CPU_ATTENTION[str(func)](*shapes[: 4 if "backward" in str(func) else 3])
    if str(func) in EXPERTS:  # the experts' matmuls, which the counter skips: backward does two
        return (2 if "backward" in str(func) else 1) * 2 * args[0].numel() * args[1].shape[-1]
    count = flop_registry.get(func._overloadpacket)
    return count(*args, **kwargs, out_val=out) if count else 0


def simulated_compiler(gm, example_inputs):
    """Inductor's decompositions and partition of a block's forward and backward graphs (which decides what
    the forward saves), the graphs then run one operation at a time on fake tensors, each value freed after
    its last use."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    def interpreted(graph, _inputs):
        def run(args):
            return torch.fx.Interpreter(graph).boxed_run(args)

        run._boxed_call = True
        return run

    partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    return aot_module_simplified(gm, example_inputs, fw_compiler=interpreted, bw_compiler=interpreted,
                                 partition_fn=partition, decompositions=select_decomp_table())  # fmt: skip


@functools.cache
def track_recomputed_randomness():
    """A checkpointed region recomputed in a compiled backward replays its random operations (flash attention
    counts as one) through two higher-order operators, which a dispatch mode must handle itself."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    def save_and_run(mode, op, *args, **kwargs):
        return torch.get_rng_state(), mode.__torch_dispatch__(op, (), args, kwargs)

    def run_with(mode, _state, op, *args, **kwargs):
        return mode.__torch_dispatch__(op, (), args, kwargs)

    for mode in (Tracker, Recorder):
        run_and_save_rng_state.py_impl(mode)(save_and_run)
        run_with_rng_state.py_impl(mode)(run_with)


def experts_on_fake_tensors():
    """transformers' own grouped matmul for experts of any dtype but bf16 (aten's shape rule refuses them)."""
    from transformers.integrations import moe

    aten_takes = moe._can_use_grouped_mm

    def bf16_alone(input, weight, offs):
        return weight.dtype == torch.bfloat16 and aten_takes(input, weight, offs)

    return unittest.mock.patch.object(moe, "_can_use_grouped_mm", bf16_alone)


def simulate_step(args, model_config, world_size, ranks_per_node, fused, accumulation):
    """(peak bytes per rank by category, the operations) of an optimizer step of `accumulation` micro-steps (1
    or 2: a third looks like the second), the second of two (the first allocates the optimizer state,
    compiles, and fake DTensors allocate extra once). fused: AdamW's fused kernels (a GPU's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    simulated = copy.copy(args)
    simulated.cpu_offload = False  # see simulate(): offloading is subtracted, not simulated
    track_recomputed_randomness()
    torch._dynamo.reset()  # a block compiled by an earlier simulation guards on its fake tensors
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        mesh = device_mesh(simulated, "cpu", world_size, ranks_per_node)
        with FakeTensorMode(allow_non_fake_inputs=True), experts_on_fake_tensors():  # the recomputation's
            device = torch.device("cpu")  # saved random state is real
            model = build_model(model_config, simulated, device, mesh, backend=simulated_compiler)
            optimizer = build_optimizer(model, args, fused=fused)
            tokens = torch.randint(0, model_config.vocab_size, (args.batch_size, args.seq_length))
            batches = itertools.repeat((tokens, tokens))
            train_step(model, batches, optimizer, 1, args.grad_clip, StopRequests())
            tracker = Tracker(model, optimizer, gloo=not fused and world_size > 1)
            recorder = Recorder(ranks_per_node)
            with tracker, recorder:
                # The tracker takes a second forward of the root for a second iteration; a micro-step is not.
                hook = model.register_forward_pre_hook(lambda *_: tracker.reset_mod_stats(), prepend=True)
                train_step(model, batches, optimizer, accumulation, args.grad_clip, StopRequests())
                hook.remove()
            snapshot = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    by_kind = {getattr(kind, "value", kind): size for per_device in snapshot.values()
               for kind, size in per_device.items()}  # fmt: skip
    memory = {name: sum(by_kind.get(kind, 0) for kind in kinds) for name, kinds in MEMORY_CATEGORIES.items()}
    return memory, recorder.operations


def simulate(args, model_config, world_size, n_params, ranks_per_node=None, fused=None):
    """(peak per rank in GB by category, the step's Work) on the dry run's target (--gpus_per_node GPUs a
    node with fused AdamW, or --gpu=cpu) unless ranks_per_node and fused say. DDP's replicas cannot be faked
    (DDP reads its parameters' data), nor CPU tensors told apart from GPU ones: both are estimated."""
    ranks_per_node = ranks_per_node or min(args.gpus_per_node, world_size)
    fused = args.gpu != "cpu" if fused is None else fused
    accumulation = args.global_batch_size // (args.batch_size * world_size)
    traced = min(2, accumulation)
    all_reduce = None
    if args.sharding == "ddp":
        as_full = types.SimpleNamespace(**dict(vars(args), sharding="full"))
        memory, operations = simulate_step(as_full, model_config, 1, 1, fused, traced)
        memory["gradients"] += 4 * n_params
        nodes = max(1, world_size // ranks_per_node)
        all_reduce = Operation(0, None, ("all_reduce", 4 * n_params, world_size, nodes))
    else:
        memory, operations = simulate_step(args, model_config, world_size, ranks_per_node, fused, traced)
    if args.cpu_offload:
        memory.update({name: 0 for name in OFFLOADED})
    last = max((index for index, operation in enumerate(operations) if operation.backward), default=-1)
    rest = operations[last + 1 :] + ([all_reduce] if all_reduce else [])
    work = Work(operations[: last + 1], rest, accumulation / traced)
    return {name: size / 1e9 for name, size in memory.items()}, work


@dataclasses.dataclass
class Work:
    """What one rank does in a step: the micro-steps traced, `times` over (each later micro-step does what one
    of them did on average), then the rest: clipping, the optimizer, DDP's all-reduce."""

    micro_steps: list
    rest: list
    times: float
