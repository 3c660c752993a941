import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
sys.path.insert(0, str(REPO))  # tests import train.py, its modules in run/, and benchmark.py
import forked  # noqa: E402

from common.quiet import torchao_for_float8_only  # noqa: E402
from run import options  # noqa: E402

torchao_for_float8_only()  # as the scripts do: see common/quiet.py
REAL_PROCESSES = os.environ.get("REAL_PROCESSES") == "1"

# A small, fast CPU configuration of the tiny preset that learns within a few dozen steps.
TINY = [
    "--model=tiny",
    "--compile=False",
    "--activation_checkpointing=none",
    "--batch_size=8",
    "--global_batch_size=16",
    "--seq_length=128",
    "--lr=3e-3",
    "--min_lr=1e-4",
    "--warmup_steps=10",
    "--log_every=1",
    "--curves=False",  # matplotlib costs each run ~0.8 s of CPU; test_run_folder.py checks the curves
    "--predict=False",  # tracing and timing the step costs each run seconds; test_predict.py checks it
]

# For the tests that simulate a run (--dry_run, --plan, an option left to auto), which an older torch refuses:
# on the GPU image's torch 2.11 they are skipped, and the rest of the suite runs.
SIMULATES = pytest.mark.skipif(
    torch.__version__ < options.SIMULATING_TORCH,
    reason=f"simulating a run needs torch {options.SIMULATING_TORCH} or later",
)

# A stopped rank, named by its last heartbeat (computing while the others wait) or by its silence after it
BLAMED = r"rank {rank} (was computing \(step \d+\) while the others waited|sent no heartbeat for \d+ s)"


def pytest_configure(config):
    """Once per run of the suite, before pytest-xdist starts its workers, which inherit the environment:
    inductor compiles into a fresh, empty cache, as on a newcomer's machine, shared by the run's launches,
    and in the process that compiles (a pool of compile workers, each importing torch, costs a 2-core machine
    more than it saves)."""
    config.addinivalue_line("markers", "timing: compares figures measured on this machine; run alone")
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller has set them
        return
    config.inductor_cache = tempfile.mkdtemp(prefix="inductor-cache-")
    os.environ.update(TORCHINDUCTOR_CACHE_DIR=config.inductor_cache, TORCHINDUCTOR_COMPILE_THREADS="1")
    # One thread per process, as torchrun gives each of several workers: the suite runs several processes on
    # two cores, and OpenMP threads with no core to run on spin while they wait.
    os.environ["OMP_NUM_THREADS"] = "1"


# The files in the order their real runs take longest, longest first. pytest-xdist hands out whole files
# in this order (run.sh: --no-loadscope-reorder), so that no long file starts last and holds one core alone.
LONGEST_FIRST = [
    "test_slurm.py",  # its jobs wait on the queue and limits at times: the other worker fills the cores then
    "test_checkpoint.py",
    "test_quickstart.py",  # five jobs, each started, then stopped
    "test_compiled.py",
    "test_models.py",
    "test_data.py",
    "test_run_folder.py",
    "test_non_finite.py",  # eight short launches, all but one of a single process
    "test_dry_run.py",
    "test_train.py",
    "test_benchmark.py",
    "test_diagnose.py",
]


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: a file's tests keep their order


def pytest_unconfigure(config):
    if hasattr(config, "inductor_cache"):
        shutil.rmtree(config.inductor_cache, ignore_errors=True)


def parse_options(argv):
    """train.py's options from argv, as main() parses them."""
    return options.parse(argv)


def validated(args):
    """args checked and completed as main() does; returns the model's shape."""
    return options.complete_and_check(args)


def bare_model(model_config, args):
    """The model run/model/build.py builds for --sharding=ddp (its blocks checkpointed and compiled as args
    say), without the DDP wrapper it takes on a process group of one: its hooks stay idle."""
    import torch.distributed as dist

    from run.model import build

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        return build.build_model(model_config, args, torch.device("cpu"), mesh=None).module
    finally:
        dist.destroy_process_group()


def torchrun_command(script, args, nproc, torchrun_args=()):
    """script under torchrun with nproc CPU processes, or as a plain process when nproc is 0. --standalone
    binds the rendezvous store to a port the kernel picks: a port found free beforehand can be taken by
    another launch's store before torchrun binds it, and torchrun then joins that store as its client, and
    stops its workers when that launch ends (a CI run failed so)."""
    if not nproc:
        return [sys.executable, str(REPO / script), *args]
    launcher = [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", *torchrun_args]
    return [*launcher, str(REPO / script), *args]


def launch(script, args, nproc=2, cwd=REPO, timeout=300, env=None):
    """script with nproc processes under torchrun, or as a plain process when nproc is 0: torchrun and its
    workers, or the process, forked from a zygote that has imported the scripts where it can be
    (tests/forked.py), else new interpreters, as every launch is with REAL_PROCESSES=1."""
    full_env = {**os.environ, **(env or {})}
    command = torchrun_command(script, args, nproc)
    if not REAL_PROCESSES:
        full_env = forked.with_forked_workers(full_env, nproc) if nproc else full_env
        script_and_args = command if nproc else command[1:]  # torchrun's script, or the Python's
        if forked.zygote_for(full_env):
            return forked.run_script(script_and_args[0], script_and_args[1:], cwd, full_env, timeout)
    return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def together(*calls):
    """Runs independent launches (zero-argument callables) and returns their results in order: two at a
    time, or one at a time in a pytest-xdist worker, whose sibling keeps the second core busy. Much of a
    launch is one process importing torch on one core; more launches than cores only slow each other."""
    with ThreadPoolExecutor(max_workers=1 if os.environ.get("PYTEST_XDIST_WORKER") else 2) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def worker_pids(torchrun_pid):
    """The training processes torchrun started, by local rank."""
    ranks = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue  # exited meanwhile
        local_rank = [v for v in environ if v.startswith(b"LOCAL_RANK=")]
        if parent == torchrun_pid and local_rank:
            ranks[int(local_rank[0].split(b"=")[1])] = int(stat.parent.name)
    return ranks


def run_until(args, tmp, step, signal_number, extra_torchrun=(), env=None):
    """Starts a 2-process run and sends signal_number to local rank 1 once `step` is logged: to the worker's
    stand-in where the workers are forks (tests/forked.py), which passes it on, or is killed with it."""
    command = torchrun_command("train.py", [f"--log_dir={tmp}", *args], 2, list(extra_torchrun))
    full_env = {**os.environ, **(env or {})}
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env if REAL_PROCESSES else forked.with_forked_workers(full_env, 2),
    )
    output = []
    for line in process.stdout:
        output.append(line)
        if line.startswith(f"step {step:>6}/"):
            os.kill(worker_pids(process.pid)[1], signal_number)
            break
    output += process.stdout.readlines()
    process.wait(timeout=120)
    return process.returncode, "".join(output)


def run_folder(log_dir):
    """The one run folder, <log_dir>/<run_name>, that a test's runs wrote."""
    folders = [path.parent for path in Path(log_dir).glob("*/metrics.jsonl")]
    assert len(folders) == 1, folders
    return folders[0]


def read_metrics(log_dir):
    """The last record of each logged step of the one run in log_dir (a resumed run logs some steps again)."""
    records = {}
    for line in (run_folder(log_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = record
    return [records[step] for step in sorted(records)]


def assert_same_model(loaded, expected):
    """loaded holds exactly expected's weights, and a forward pass through either gives the same logits.
    The logits are compared to float tolerance: a BLAS kernel may take another path for a tensor that
    safetensors maps at a different memory alignment."""
    loaded_state, expected_state = loaded.state_dict(), expected.state_dict()
    assert loaded_state.keys() == expected_state.keys()
    assert [name for name in loaded_state if not torch.equal(loaded_state[name], expected_state[name])] == []
    tokens = torch.randint(0, loaded.config.vocab_size, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, expected(tokens).logits)


def assert_ran(result):
    """A launch exited 0; if not, the ends of its output say why."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


def error_lines(stderr):
    """train.py's own error lines, not torchrun's report of the failed worker."""
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def assert_rank_0_failed_first_with_status_2(result):
    """Under torchrun, which itself exits 1: its report's first failure is rank 0's status 2, the rank that
    says the error; the others left after it."""
    root_cause = result.stderr.rsplit("Root Cause", 1)[-1]
    first = re.search(r"rank\s*: 0 \(local_rank: 0\)\s*exitcode\s*: 2 ", root_cause)
    assert result.returncode == 1 and first, result.stderr[-3000:]


def run_training(tmp_path, *args, nproc=2, expect_ok=True, **kwargs):
    """train.py with its logs and checkpoints in tmp_path; by default it must succeed."""
    result = launch(
        "train.py",
        [f"--log_dir={tmp_path}", f"--checkpoint_dir={tmp_path}", *args],
        nproc=nproc,
        **kwargs,
    )
    if expect_ok:
        assert_ran(result)
    return result


@pytest.fixture(autouse=True)
def environment_as_before():
    """The test process's environment as it was before each test. A script's main() run in it changes it for
    good: HF_HUB_OFFLINE=1 once the hub is unreachable, TOKENIZERS_PARALLELISM once a tokenizer has run.
    Left over, either makes every later launch of this process a new interpreter instead of a fork
    (tests/forked.py serves only environments like its zygotes'): in one run of the suite, most of a
    worker's later launches, seconds of CPU each. Only what changed is put back, as background threads
    (test_slurm.py's jobs) may read it meanwhile."""
    before = dict(os.environ)
    yield
    for name in os.environ.keys() - before.keys():
        del os.environ[name]
    os.environ.update({name: value for name, value in before.items() if os.environ.get(name) != value})


@pytest.fixture
def train():
    return run_training


@pytest.fixture
def job_signals(monkeypatch):
    """SIGUSR1 and SIGTERM to this process go to the start of the job running now, as main() sets it up."""
    from run.job import job

    original = job.Job.__init__

    def init(start, *args):
        original(start, *args)
        for number in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(number, start.on_signal)

    monkeypatch.setattr(job.Job, "__init__", init)
    previous = {number: signal.getsignal(number) for number in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for number, handler in previous.items():
        signal.signal(number, handler)


@pytest.fixture
def reports_in_tmp(tmp_path, monkeypatch):
    """The job's default report folder, logs/, is relative: the tests of the job run in tmp_path (each of
    their files uses it for all its tests)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()


@pytest.fixture(scope="module")
def small_disks(tmp_path_factory):
    """tmpfs folders of a given size in MiB, unmounted after the module; skipped where mounting is not
    permitted."""
    mounted = []

    def mount(size_mib):
        folder = tmp_path_factory.mktemp("disk")
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(folder)],
            capture_output=True,
            text=True,
        )
        if result.returncode:
            pytest.skip(f"cannot mount a tmpfs ({result.stderr.strip() or 'not permitted'}): needs root")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=True)


class Hung(BaseException):
    """A read that would never end. Not an OSError (as TimeoutError is), which a reader may catch and then
    read again."""


@pytest.fixture
def deadline():
    """A read that would hang fails the test instead of holding the suite: one waiting on a FIFO after 20 s
    (a read takes milliseconds), and every 5 s after should a reader catch it; one reading /dev/zero to its
    end with a MemoryError once it has taken 2 GB (the kernel's read never returns to Python, which would see
    the alarm only once memory ran out)."""

    def expired(*_):
        raise Hung("the read hung")

    previous = signal.signal(signal.SIGALRM, expired)
    limits = resource.getrlimit(resource.RLIMIT_AS)
    in_use = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    ceiling = in_use + (2 << 30)
    resource.setrlimit(
        resource.RLIMIT_AS, (min(ceiling, limits[1]) if limits[1] >= 0 else ceiling, limits[1])
    )
    signal.setitimer(signal.ITIMER_REAL, 20, 5)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, limits)


# What can stand where a file is kept, and how its refusal names it (common/files.py)
ODD = {
    "FIFO": (os.mkfifo, "is a FIFO, not a regular file"),
    "link to /dev/zero": (
        lambda path: os.symlink("/dev/zero", path),
        "is a symbolic link, not a regular file",
    ),
    "folder": (os.mkdir, "is a folder, not a regular file"),
    "file of 2 MB": (
        lambda path: Path(path).write_bytes(bytes(2_000_000)),
        "holds more than 1,048,576 bytes, more than any of its kind",
    ),
}


def make_odd(path, kind):
    """An odd file of that kind at path; its refusal's words."""
    make, words = ODD[kind]
    make(str(path))
    return words


def fill_disk(folder):
    """Writes a filler file into folder until its disk is full."""
    with contextlib.suppress(OSError), open(folder / "filler", "wb") as file:
        while True:
            file.write(bytes(65536))
            file.flush()
