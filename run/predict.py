"""The step's time before launch, from the step itself. The dry run's fake step is recorded operation by
operation (StepRecorder): each one's shapes, FLOPs and bytes, the collectives with their sizes and groups, and
which tensors each reads and writes. Each operation is then costed on a machine (run/machines.py) and the
step is played on a device's streams in the order FSDP issues the work (play): an all-gather waits for its
inputs and its stream, a layer's compute for its gathered weights, so what communication hides behind compute
falls out of the order. Predicts one rank's step; the ranks of FSDP do the same work."""

import dataclasses
import functools

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from common.op_timing import CPU_ATTENTION, TensorMeta, resolve, signature

# Operations that compute nothing: views, allocations, the profiler's marks.
FREE = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
        "prim.device.default", "aten.lift_fresh.default", "profiler._record_function_enter_new.default",
        "profiler._record_function_exit._RecordFunction", "_c10d_functional.wait_tensor.default"}  # fmt: skip
# The collectives FSDP and DTensor issue, by kind.
COLLECTIVES = {"allgather": "all-gather", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
               "allreduce": "all-reduce", "all_reduce": "all-reduce", "broadcast": "broadcast"}  # fmt: skip
# FSDP2 copies into its all-gather buffer and its reduce-scatter buffer on the collectives' streams.
COMM_STREAM_COPIES = {"fsdp.all_gather_copy_in.default", "fsdp.chunk_cat.default"}
# Fake tensors' queries of their device: recorded, never dispatched by an eager step on real tensors.
FAKE_ONLY = {"prim.device.default"}
# DDP's gradient all-reduce, which its C++ reducer issues where no dispatch mode sees it, in its buckets.
DDP_ALL_REDUCE, DDP_BUCKET_BYTES = "ddp.all_reduce.buckets", 25 * 2**20
# The host waits for the device: .item(), .tolist(); DDP's reducer, for its all-reduce, before the optimizer.
HOST_SYNC = {"aten._local_scalar_dense.default", DDP_ALL_REDUCE}


@dataclasses.dataclass
class Event:
    """One operation of the step, as one rank issues it."""

    name: str
    args: tuple
    kwargs: dict
    reads: tuple  # storages read and written, by id
    writes: tuple
    flops: float
    bytes: float
    backward: bool  # inside autograd's backward
    grad_enabled: bool  # a recomputation inside the backward has grad enabled; the backward's own ops not
    collective: tuple | None = None  # (kind, bytes, group size, nodes spanned)
    in_layer: bool = False  # inside a decoder layer's forward, which the ranks time as they train
    host_scale: float = 1.0  # the model's host time an operation over a small model's (run/simulation.py)
    allocates: tuple = ()  # (storage, bytes) of each new storage it returns
    phase: str = ""  # forward, recomputation, backward, optimizer (set by phases())

    @functools.cached_property
    def key(self):
        return signature(self.name, self.args, self.kwargs)

    @functools.cached_property
    def free(self):
        """A view, an allocation or a mark: what computes nothing."""
        return self.name in FREE or is_view(self.name)


@functools.cache
def is_view(name):
    """Whether every output of the operation is a view of an input."""
    try:
        returns = resolve(name)._schema.returns
    except AttributeError:
        return False
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class StepRecorder(TorchDispatchMode):
    """Records every operation one rank runs, below DTensor (which it lets decompose first into the local
    operations and collectives a rank really runs). ranks_per_node: to tell a collective inside a node from
    one between nodes."""

    def __init__(self, ranks_per_node):
        super().__init__()
        self.events, self.ranks_per_node, self.in_layer = [], ranks_per_node, False

    def watch_layers(self, layers):
        """Marks the events of each decoder layer's forward (not of its recomputation)."""
        for layer in layers:
            layer.register_forward_pre_hook(lambda *_: setattr(self, "in_layer", torch.is_grad_enabled()))
            layer.register_forward_hook(lambda *_: setattr(self, "in_layer", False))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        mutated = [argument.name for argument in func._schema.arguments
                   if argument.alias_info is not None and argument.alias_info.is_write]  # fmt: skip
        named = dict(zip((argument.name for argument in func._schema.arguments), args)) | kwargs
        reads = storages((args, kwargs))
        writes = storages(out) + storages([named[name] for name in mutated if name in named])
        allocates = {}  # the new storages it returns, whose pages a CPU step touches for the first time
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage()._cdata not in reads:
                allocates[leaf.untyped_storage()._cdata] = leaf.untyped_storage().nbytes()
        self.events.append(
            Event(
                name=str(func), args=tree_map(TensorMeta.of, args), kwargs=tree_map(TensorMeta.of, kwargs),
                reads=reads, writes=writes, flops=operation_flops(func, args, kwargs, out),
                bytes=tensor_bytes((args, kwargs, out)), backward=torch._C._current_graph_task_id() != -1,
                grad_enabled=torch.is_grad_enabled(), collective=self.collective(func, args),
                in_layer=self.in_layer, allocates=tuple(allocates.items()),
            )
        )  # fmt: skip
        return out

    def collective(self, func, args):
        """(kind, bytes moved as nccl-tests sizes them, group size, nodes the group spans), or None."""
        name = str(func)
        kind = next((kind for word, kind in COLLECTIVES.items() if word in name), None)
        if kind is None or not name.startswith(("c10d.", "_c10d_functional.")):
            return None
        tensors = [leaf for leaf in tree_leaves(args) if isinstance(leaf, torch.Tensor)]
        boxed = next((leaf for leaf in tree_leaves(args) if isinstance(leaf, torch.ScriptObject)), None)
        if boxed is not None:  # c10d's own operations take the group itself; functional ones its name
            group = dist.ProcessGroup.unbox(boxed)
        else:
            group = dist.distributed_c10d._resolve_process_group(args[-1])
        ranks = dist.get_process_group_ranks(group)
        nodes = len({rank // self.ranks_per_node for rank in ranks})
        # nccl-tests' sizes: an all-gather's output, a reduce-scatter's input, an all-reduce's tensor
        moved = max(t.numel() * t.element_size() for t in tensors) if tensors else 0
        if kind == "all-reduce":
            moved = sum(t.numel() * t.element_size() for t in tensors)
        return kind, moved, len(ranks), nodes


def storages(value):
    return tuple(
        leaf.untyped_storage()._cdata for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)
    )


def tensor_bytes(value):
    seen, total = set(), 0
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and id(leaf) not in seen:
            seen.add(id(leaf))
            total += leaf.numel() * leaf.element_size()
    return total


def operation_flops(func, args, kwargs, out):
    """FLOPs as torch's FLOP counter counts them; CPU flash attention (not in its registry) as its CUDA twin,
    whose shapes are the same."""
    shapes = [tuple(leaf.shape) for leaf in args[:4] if isinstance(leaf, torch.Tensor)]
    if CPU_ATTENTION.get(str(func)) == "forward":
        return sdpa_flop_count(*shapes[:3])
    if CPU_ATTENTION.get(str(func)) == "backward":
        return sdpa_backward_flop_count(*shapes[:4])
    count = flop_registry.get(func._overloadpacket)
    if count is None:
        return 0
    shaped = tree_map(lambda v: v.shape if isinstance(v, torch.Tensor) else v, (args, kwargs, out))
    try:
        return count(*shaped[0], **shaped[1], out_shape=shaped[2])
    except TypeError:
        return 0


def phases(events):
    """Sets each event's phase: the backward's own operations; the forward's recomputed inside it; the
    forward (every operation before the last backward one); the optimizer (clipping, the update, the stop
    flag: all that comes after)."""
    last_backward = max((index for index, event in enumerate(events) if event.backward), default=-1)
    for index, event in enumerate(events):
        if event.backward:
            event.phase = "recomputation" if event.grad_enabled else "backward"
        else:
            event.phase = "forward" if index < last_backward else "optimizer"
    return events


def with_accumulation(events, traced, accumulation):
    """The events of a step of `accumulation` micro-steps, from a recording of `traced` (1 or 2): the second
    micro-step, which looks like every later one, is repeated."""
    if accumulation <= traced:
        return events
    starts = [index for index, event in enumerate(events) if event.phase == "forward" and
              (index == 0 or events[index - 1].phase in ("backward", "recomputation"))]  # fmt: skip
    last = starts[-1]
    optimizer = next(index for index, event in enumerate(events) if event.phase == "optimizer")
    return events[:optimizer] + events[last:optimizer] * (accumulation - traced) + events[optimizer:]


def with_ddp_all_reduce(events, gradient_bytes, world_size, nodes):
    """A DDP step's events: the step as traced without DDP (run/simulation.py), and before the optimizer,
    the all-reduce of every gradient in DDP's buckets."""
    optimizer = next(index for index, event in enumerate(events) if event.phase == "optimizer")
    buckets = [
        min(DDP_BUCKET_BYTES, gradient_bytes - start) for start in range(0, gradient_bytes, DDP_BUCKET_BYTES)
    ]
    all_reduce = [
        Event(name=DDP_ALL_REDUCE, args=(), kwargs={}, reads=(), writes=(), flops=0, bytes=size,
              backward=False, grad_enabled=False, collective=("all-reduce", size, world_size, nodes),
              phase="optimizer")
        for size in buckets
    ]  # fmt: skip
    return events[:optimizer] + all_reduce + events[optimizer:]


def fresh_bytes(events):
    """Per event, the bytes of memory it writes that the step has not held before: what its new storages add
    to the step's high-water mark of live memory, a storage living from the event that returns it to the
    last that uses it (its address, once it is freed, may name a new one)."""
    freed, last, live_size = [[] for _ in events], {}, {}
    for index, event in enumerate(events):
        for storage, size in event.allocates:
            if storage in live_size:
                freed[last[storage]].append(live_size[storage])
            live_size[storage], last[storage] = size, index
        for storage in event.reads + event.writes:
            if storage in live_size:
                last[storage] = index
    for storage, size in live_size.items():
        freed[last[storage]].append(size)
    fresh, live, high = [], 0, 0
    for event, given_back in zip(events, freed):
        live += sum(size for _, size in event.allocates)
        fresh.append(max(0, live - high))
        high = max(high, live)
        live -= sum(given_back)
    return fresh


@dataclasses.dataclass
class Prediction:
    step_s: float
    parts: dict  # name -> seconds, adding up to step_s
    layer_forward_s: float  # the decoder layers' forward, of parts["forward"]
    costed: dict  # how the operations were costed: source -> count
    notes: list  # what the prediction cannot see

    def line(self):
        compute = sum(self.parts[name] for name in ("forward", "backward", "recomputation"))
        exposed = sum(seconds for name, seconds in self.parts.items() if name.startswith("exposed "))
        collectives = ", ".join(f"{name.removeprefix('exposed ')} {self.parts[name]:.3g}"
                                for name in self.parts if name.startswith("exposed "))  # fmt: skip
        parts = self.parts
        return (
            f"predicted step: {self.step_s:.3g} s = compute {compute:.3g} (forward {parts['forward']:.3g}, "
            f"backward {parts['backward']:.3g}, recomputation {parts['recomputation']:.3g}) + exposed "
            f"communication {exposed:.3g} ({collectives or 'none'}) + optimizer {parts['optimizer']:.3g} + "
            f"the rest {parts['rest']:.3g}"
        )


def play(events, machine):
    """One rank's step on the machine: the host issues the events in order; each runs on its stream (the
    collectives and FSDP's copies on the communication stream where the device overlaps them, everything on
    one where it does not) once its stream is free and what it reads is written. Returns the Prediction:
    compute by phase, the time compute waited for each kind of collective (exposed), the optimizer, the
    rest (the host falling behind the device)."""
    finish, writer, free, costed = [], {}, {"host": 0.0, "compute": 0.0, "comm": 0.0}, {}
    fresh = fresh_bytes(events)
    parts = dict.fromkeys(("forward", "backward", "recomputation", "optimizer", "rest"), 0.0)
    layer_forward = 0.0
    for index, event in enumerate(events):
        seconds, source = machine.seconds(event)
        seconds += machine.first_touch_seconds(fresh[index])
        costed[source] = costed.get(source, 0) + 1
        stream = (
            "comm"
            if machine.overlaps and (event.collective or event.name in COMM_STREAM_COPIES)
            else "compute"
        )
        issued = free["host"] = free["host"] + machine.issue_seconds(event)
        waits_for = [writer[storage] for storage in event.reads + event.writes if storage in writer]
        ready = max((finish[other] for other in waits_for), default=0.0)
        start = max(issued, ready, free[stream])
        if stream == "compute" and start > free["compute"]:
            gap = start - free["compute"]
            gating = max(waits_for, key=lambda other: finish[other], default=None)
            if ready > issued and gating is not None and events[gating].collective:
                kind = f"exposed {events[gating].collective[0]}"
                parts[kind] = parts.get(kind, 0.0) + gap
            else:
                parts["rest"] += gap
        finish.append(start + seconds)
        free[stream] = finish[-1]
        if stream == "compute":
            if event.collective:  # where nothing overlaps, a collective's whole time is exposed
                kind = f"exposed {event.collective[0]}"
                parts[kind] = parts.get(kind, 0.0) + seconds
            else:
                parts[event.phase] += seconds
                layer_forward += seconds if event.in_layer else 0.0
        for storage in event.writes:
            writer[storage] = index
        if event.name in HOST_SYNC:
            free["host"] = max(free["host"], finish[-1])
    step = max(finish, default=0.0)
    parts["rest"] += step - sum(parts.values())
    return Prediction(step, parts, layer_forward, costed, list(machine.notes))
