"""Launch: the machine check, the run's folders and lock (one trainer per run), the device and the process
group, and the end of a run."""

import contextlib
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from common.errors import ConfigError, exit_after_the_speaker, fail
from common.files import UnsafeFile, no_links, read_json
from common.node import available_memory_bytes, local_device
from run.checkpoint.checkpointer import checkpoint_step
from run.health.watchdog import PG_TIMEOUT_FIRST_STEP, flight_recorder_env
from run.options import launched_world_size


def check_machine_holds(args, meta_model):
    """Refuses, before any model is built, a run whose weights, gradients and AdamW state alone (16 bytes a
    parameter in fp32, sharded over the ranks) exceed this node's memory: GPU memory, or host memory."""
    n_params = sum(p.numel() for p in meta_model.parameters())
    world_size = launched_world_size(args)
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    shards = 1 if args.sharding == "ddp" else world_size
    if torch.cuda.is_available():
        needed, where = 16 * n_params / shards, "per GPU"
        available = torch.cuda.get_device_properties(0).total_memory
    else:
        needed, where = 16 * n_params / shards * local_world_size, "of host memory on this node"
        available = available_memory_bytes()
    if needed > available:
        check = "python train.py --dry_run"
        fix = f"on a CPU use --model=tiny; for GPUs, sbatch slurm_submit.sh (check first with {check})"
        if torch.cuda.is_available():
            fix = f"on GPUs, check a config with {check}"
        raise ConfigError(
            f"--model={args.init_from or args.model} needs at least {needed / 1e9:.1f} GB {where} for "
            f"its weights, gradients and optimizer state; {available / 1e9:.1f} GB are available: {fix}"
        )


RUN_LOCK = "trainer.lock"

LOCK_HEARTBEAT_S = 30

LOCK_STALE_S = 300  # a lock whose heartbeat is this old, held on another host, is abandoned


class RunFolders:
    """The run's checkpoint folder (run_dir), its log folder (logs, config, curves, diagnostics) and its lock,
    which rank 0 takes before any process group: a second launch of the same run stops here. The lock is
    released where the with block of these folders ends, however the run ends."""

    def __init__(self, args):
        self.run_dir = os.path.join(args.checkpoint_dir, args.run_name)
        self.log_folder = os.path.join(args.log_dir, args.run_name)
        os.makedirs(self.run_dir, exist_ok=True)
        os.makedirs(self.log_folder, exist_ok=True)
        self.lock = take_run_lock(self.run_dir) if os.environ.get("RANK", "0") == "0" else None

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        release_run_lock(self.lock)


def lock_is_stale(holder, age):
    """The holder is gone: the same SLURM job, requeued; or it ran on this host and its pid is dead;
    or, on another host, its heartbeat stopped. An unreadable lock was never a live trainer's."""
    if holder.get("unreadable"):
        return True
    if holder.get("job_id") and holder["job_id"] == os.environ.get("SLURM_JOB_ID"):
        return True
    if holder.get("host") == socket.gethostname():
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, run by another user
            return False
        return False
    return age > LOCK_STALE_S


def own_lock(path):
    """This launch's lock, <lock>.<host>.<pid>, written whole before it is linked into place as the lock; a
    ConfigError where it cannot be written."""
    mine = f"{path}.{socket.gethostname()}.{os.getpid()}"
    me = {"host": socket.gethostname(), "pid": os.getpid(), "job_id": os.environ.get("SLURM_JOB_ID")}
    try:
        with contextlib.suppress(FileNotFoundError):
            os.remove(mine)  # a crashed start's of the same pid; a link is removed, never followed
        with open(mine, "x", opener=no_links) as file:
            json.dump(me, file)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.remove(mine)
        raise ConfigError(
            f"cannot write the run's lock {path} ({error.strerror}); free space there or set another "
            f"--checkpoint_dir"
        ) from None
    return mine


def take_run_lock(run_dir):
    """One trainer per run: rank 0 holds <run_dir>/trainer.lock (host, pid, SLURM job id), its mtime
    refreshed as a heartbeat. Returns the lock's path; a live holder is a ConfigError naming it."""
    path = os.path.join(run_dir, RUN_LOCK)
    mine = own_lock(path)
    try:
        while True:
            try:
                os.link(mine, path)  # atomic, and fails if the lock exists, also on NFS
                break
            except FileExistsError:
                pass
            try:
                holder = read_json(path)
                if not isinstance(holder, dict):
                    raise ValueError("not a lock")
                age = time.time() - os.path.getmtime(path)
            except FileNotFoundError:  # released meanwhile
                continue
            except (OSError, UnsafeFile, ValueError):  # a lock is linked whole: one unreadable has no holder
                holder, age = {"unreadable": True}, 0.0
            if not lock_is_stale(holder, age):
                job = f", SLURM job {holder['job_id']}" if holder.get("job_id") else ""
                raise ConfigError(
                    f"run {run_dir} is already being trained by pid {holder.get('pid', '?')} "
                    f"on {holder.get('host', '?')}{job} (lock {path}); wait for it to finish, "
                    f"or set another --run_name or --checkpoint_dir"
                )
            try:  # the rename lets only one of several launches take a stale lock over
                os.rename(path, mine + ".stale")
            except FileNotFoundError:
                continue
            os.remove(mine + ".stale")
            gone = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, which is gone"
            if holder.get("unreadable"):
                gone = "no one: it is empty or unreadable (a lock is written whole before it is taken)"
            print(f"taking over the lock of run {run_dir} from {gone}", flush=True)
    finally:
        os.remove(mine)

    def heartbeat():
        while True:
            time.sleep(LOCK_HEARTBEAT_S)
            with contextlib.suppress(OSError):
                os.utime(path)

    threading.Thread(target=heartbeat, daemon=True).start()
    return path


def release_run_lock(path):
    """Removes the lock if this process holds it; path is None on ranks other than 0."""
    with contextlib.suppress(OSError, UnsafeFile, ValueError, KeyError, TypeError):
        if read_json(path)["pid"] == os.getpid():
            os.remove(path)


def setup_distributed(args, log_folder):
    """(device, rank, world size, device mesh), the process group started. A plain `python train.py` is a
    process group of one that meets in memory: it needs no port, so none can be taken by another run."""
    store = None
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        store = dist.HashStore()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    if torch.cuda.is_available():
        # Segments that grow in place instead of new blocks: less fragmentation as sequence shapes and
        # FSDP's all-gather buffers come and go (torchtitan's launcher sets it too). A user's setting wins.
        if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
            os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
        flight_recorder_env(os.environ, log_folder)
        device = local_device()
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.compile:
        check_compiler(device)
    if device.type == "cpu" and args.mixed_precision == "bf16" and rank == 0:
        warn_if_bf16_is_slow()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Workers restarted by torchrun --max-restarts meet in the same agent store as the failed attempt;
        # without a per-attempt prefix they would read the dead workers' addresses and hang.
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        agent_store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timedelta(minutes=30))
        store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent_store)
    cuda = device.type == "cuda"
    # Offloaded gradients are CPU tensors: their norm needs a CPU backend beside NCCL. device_id binds
    # NCCL's communicator to this GPU at once, instead of guessing it at the first collective.
    backend = ("cuda:nccl,cpu:gloo" if args.cpu_offload else "nccl") if cuda else "gloo"
    options = dict(timeout=PG_TIMEOUT_FIRST_STEP, device_id=device if cuda else None)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **options)
    mesh = device_mesh(args, device.type, world_size, int(os.environ["LOCAL_WORLD_SIZE"]))
    return device, rank, world_size, mesh


def check_compiler(device):
    """--compile needs a toolchain: a C++ compiler for CPU kernels, Triton and libcuda for GPU ones. Compiling
    a two-line function finds out in seconds, before any data or model, instead of at the first step."""
    try:
        torch.compile(lambda x: torch.sin(x) * 2 + 1)(torch.ones(8, device=device))
    except Exception as error:  # inductor raises many types; the first line names what is missing
        needs = "a C++ compiler (g++, or $CXX)" if device.type == "cpu" else "Triton with libcuda"
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"--compile=True cannot compile for {device.type}: it needs {needs} ({first[:200]}); "
            f"install it, or use --compile=False"
        ) from None


def native_bf16():
    """Whether the CPU kernels torch runs here multiply bf16 matrices in hardware (AVX512-BF16 or AMX).
    Without, a bf16 matmul takes a slower path: 0.9 against fp32's 93 GFLOP/s on an AVX2 EPYC, 22 against 86
    on an AVX-512 Xeon. Decided from the CPU's features, not timed: a timing on a busy machine says either."""
    features = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512") and features


def warn_if_bf16_is_slow():
    if not native_bf16():
        print(
            f"warning: this CPU has no bf16 matrix instructions for torch's "
            f"{torch.backends.cpu.get_cpu_capability()} kernels, so bf16 runs slower than fp32 on it: "
            f"--mixed_precision=fp32 trains faster",
            flush=True,
        )


def device_mesh(args, device_type, world_size, local_world_size):
    """One dimension, or for --sharding=hybrid (replicate, shard): groups of --shard_group_size ranks (a
    node's by default) each hold one copy of the model, sharded."""
    if args.sharding == "hybrid":
        group = args.shard_group_size or local_world_size
        return init_device_mesh(
            device_type, (world_size // group, group), mesh_dim_names=("replicate", "shard")
        )
    return init_device_mesh(device_type, (world_size,))


def already_finished(args, resume_path, total_steps, checkpointer, master):
    """A relaunch of a run that finished: it resumes from its own checkpoint of its last step, its model
    exported, whether or not the command names that checkpoint (a rewound run's command names an earlier one,
    and goes on from the newest). A checkpoint past the run's last step is refused: training would do nothing
    and export it as if done."""
    step = checkpoint_step(resume_path) if resume_path else 0
    if step > total_steps:
        message = (
            f"run {args.run_name} is at step {step} ({resume_path}), past its {total_steps} steps; raise "
            f"--max_steps to go on, or rewind with --resume_from=<an earlier step_N>"
        )
        fail(message) if master else exit_after_the_speaker()
    exported = os.path.isdir(os.path.join(checkpointer.run_dir, "final_model"))
    own = bool(resume_path) and checkpointer.of_this_run(resume_path)
    finished = own and step == total_steps and exported
    if finished and master:
        print(
            f"run {args.run_name} already finished at step {step} ({resume_path}); nothing to do. Pass "
            f"--run_name=NEW for a new run, or a larger --max_steps to train on.",
            flush=True,
        )
    return finished


def exit_at_once(status):
    """Ends the process without the interpreter's teardown, after a finished run and a refused one alike, once
    train.py has done what must be done at the end (the run's lock released, the last heartbeat written): the
    loader's daemon thread may be inside tokenizer or Arrow code and gloo's threads still up, and finalising
    around them can abort a process that has said all it had to ("terminate called without an active
    exception", status -6, seen on a refused relaunch)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def teardown():
    """Returns 0 once every rank is done with the process group."""
    dist.barrier()  # a rank leaving while gloo still talks to it aborts the other
    dist.destroy_process_group()
    return 0
