"""Launches of the scripts (train.py, benchmark.py, sample.py), and of torchrun and its workers, forked from a
process that has imported them already: a launch then starts in milliseconds instead of the 4-5 s of CPU a
new interpreter takes to import torch and transformers, which was most of the suite's CPU (measured: one
record per process of a whole run of the suite).

The process forked from is a zygote: a new interpreter, started by the test process, that imports the
scripts' modules and runs nothing else (no test, no torch operation, no thread pool). Each launch is a fork
of it that runs the script as `python script.py args` would: as __main__, from its own folder, with its own
arguments, folder, environment and output pipes, and exits through the interpreter's own exit. It is killed
when whoever asked for it goes away.

Under torchrun, torchrun itself is such a launch, and it starts its workers as it always does, but with the
Python named by PYTHON_EXEC: a small interpreter (worker()) that has the worker forked from a second zygote,
started with the environment torchrun gives its workers, and stands in for it: it passes its signals on
and exits as the worker did. torchrun's rendezvous, its workers' process group and collectives are real.

A zygote serves only launches whose environment differs from the one it started with in what is read as the
scripts run (ranks, SLURM's variables), not in what a library reads as it is imported (threads, kernels,
caches, hub and W&B folders, HOME): any other launch starts a new interpreter.

Run as a script, this file is a zygote: `python tests/forked.py SOCKET`."""

import atexit
import contextlib
import io
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)

# What a launch's environment may hold differently from the zygote's: read as the scripts run, not as they
# import. pytest names the test it is in; torchrun names each worker's rank, its rendezvous and its Python.
FORKABLE_ENV = ("SLURM_", "SLURMD_NODENAME", "MASTER_", "BENCHMARK_REPORT", "REHEARSE_BAD_NODES",
                "PYTEST_CURRENT_TEST", "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_", "LOCAL_WORLD_SIZE",
                "WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "PYTHON_EXEC", "FORKED_ZYGOTE")  # fmt: skip
# what torchrun sets for its workers when it starts more than one, and the test process did not
WORKERS_ENV = {"OMP_NUM_THREADS": "1"}
# the signals a worker's stand-in passes on: torchrun's stops, and those a test or SLURM sends a rank
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

_zygotes = {}  # "launches" and "workers": each one's address, start environment and process
_lock = threading.Lock()


def forkable(env, started_with):
    """Whether a launch with this whole environment can be a fork of a zygote started with started_with."""
    changed = {name for name in env.keys() | started_with.keys() if env.get(name) != started_with.get(name)}
    return all(name.startswith(FORKABLE_ENV) for name in changed)


def zygote_for(env):
    """The address of the zygote a launch with the environment env can be forked from, started now if it was
    not yet; None if neither the test process's environment nor its workers' under torchrun will do."""
    with _lock:
        for name, extra in (("launches", {}), ("workers", WORKERS_ENV)):
            started_with = _zygotes[name]["env"] if name in _zygotes else {**os.environ, **extra}
            if forkable(env, started_with):
                if name not in _zygotes:
                    _zygotes[name] = start_zygote(name, started_with)
                return _zygotes[name]["address"]
    return None


def folder():
    """This test process's folder: the zygotes' sockets and the workers' Python, written with it; removed as
    it exits. Made by the first zygote's start, under the lock."""
    if "folder" not in _zygotes:
        _zygotes["folder"] = tempfile.mkdtemp(prefix="zygote-")
        atexit.register(shutil.rmtree, _zygotes["folder"], ignore_errors=True)
        script = (
            f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {TESTS!r})\n"
            "import forked\nforked.worker(sys.argv[1:])\n"
        )
        python = os.path.join(_zygotes["folder"], "python")
        with open(python, "w") as file:
            file.write(script)
        os.chmod(python, 0o755)
    return _zygotes["folder"]


def start_zygote(name, env):
    address = os.path.join(folder(), f"{name}.socket")
    process = subprocess.Popen(
        [sys.executable, __file__, address], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    if process.stdout.readline() != b"ready\n":
        raise RuntimeError(f"the launch zygote did not start (status {process.wait()})")
    atexit.register(process.stdin.close)  # the zygote exits at its end of file
    return {"address": address, "env": env, "process": process}


def with_forked_workers(env, nproc):
    """env for a torchrun whose nproc workers are forks: PYTHON_EXEC names their stand-in's interpreter."""
    workers_env = {**WORKERS_ENV, **env} if nproc > 1 else env
    address = zygote_for(workers_env)
    if address is None:
        return env
    return {**env, "PYTHON_EXEC": os.path.join(folder(), "python"), "FORKED_ZYGOTE": address}


def run_script(path, args, cwd, env, timeout):
    """`python path *args` in cwd with the environment env, forked from the zygote zygote_for(env) names; a
    subprocess.CompletedProcess with its text output, or subprocess.TimeoutExpired, as subprocess.run."""
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    request = {"path": str(path), "args": args, "cwd": str(cwd), "env": env}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(zygote_for(env))
        send_request(connection, request, [out_write, err_write])
        os.close(out_write)
        os.close(err_write)
        replies = connection.makefile("rb")
        pid = int(replies.readline())
        try:
            out, err = read_until_closed(out_read, err_read, time.monotonic() + timeout)
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            replies.readline()
            raise subprocess.TimeoutExpired([str(path), *args], timeout) from None
        status = int(replies.readline())
    return subprocess.CompletedProcess([str(path), *args], status, text(out), text(err))


def send_request(connection, request, fds):
    socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], fds)


def read_until_closed(out_fd, err_fd, deadline):
    chunks = {out_fd: [], err_fd: []}
    with selectors.DefaultSelector() as selector:
        for fd in chunks:
            selector.register(fd, selectors.EVENT_READ)
        try:
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired("", 0)
                for key, _ in selector.select(left):
                    data = os.read(key.fd, 65536)
                    chunks[key.fd].append(data)
                    if not data:
                        selector.unregister(key.fd)
        finally:
            for fd in chunks:
                os.close(fd)
    return b"".join(chunks[out_fd]), b"".join(chunks[err_fd])


def text(data):
    """As subprocess.run(text=True) decodes output: universal newlines."""
    return data.decode().replace("\r\n", "\n").replace("\r", "\n")


def worker(argv):
    """torchrun's Python for one worker, `python -u script args`: has the worker forked from the zygote
    FORKED_ZYGOTE names, with this process's folder, environment and output, passes on the signals it gets,
    and exits as the worker did; or runs the real Python where the zygote cannot serve the worker."""
    worker_pid, pending = [], []

    def pass_on(signal_number, _):
        if worker_pid:
            os.kill(worker_pid[0], signal_number)
        else:  # the worker is not forked yet
            pending.append(signal_number)

    for signal_number in PASSED_ON:
        signal.signal(signal_number, pass_on)
    reply = b"-\n"
    if argv[:1] == ["-u"] and len(argv) > 1 and not argv[1].startswith("-"):
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(os.environ["FORKED_ZYGOTE"])
        request = {"path": os.path.abspath(argv[1]), "args": argv[2:], "cwd": os.getcwd(),
                   "env": dict(os.environ), "unbuffered": True}  # fmt: skip
        send_request(connection, request, [1, 2])
        replies = connection.makefile("rb")
        reply = replies.readline()
    if reply == b"-\n":
        os.execv(sys.executable, [sys.executable, *argv])
    worker_pid.append(int(reply))
    for signal_number in pending:
        os.kill(worker_pid[0], signal_number)
    status = int(replies.readline() or -signal.SIGKILL)
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


# The zygote's side


def preload():
    """What the scripts import at their top, and what they import as they go: model classes, tokenizers,
    datasets and TensorBoard."""
    sys.path.insert(0, REPO)
    import transformers

    import benchmark  # noqa: F401
    import sample  # noqa: F401
    import train  # noqa: F401
    from common.quiet import torchao_for_float8_only

    torchao_for_float8_only()  # as the scripts do before they import a model class
    for name in ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"):
        getattr(transformers, name)
    import datasets.distributed  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401
    import transformers.masking_utils  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401


def serve(address, started_with):
    """Forks a watcher for each launch asked for, until the test process closes this one's stdin."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the watchers are reaped as they exit
    print("ready", flush=True)
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        selector.register(sys.stdin, selectors.EVENT_READ)
        while all(key.fileobj is listener for key, _ in selector.select()):
            connection, _ = listener.accept()
            if os.fork() == 0:
                selector.close()
                listener.close()
                watch(connection, started_with)
            connection.close()
    with contextlib.suppress(FileNotFoundError):  # the test process may have removed its folder already
        os.unlink(address)
    os._exit(0)  # nothing to tear down


def watch(connection, started_with):
    """A watcher: forks the launch, tells its pid, waits for it and tells its exit status; kills it if the
    other end goes away first. In the launch this returns, to run the script."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
    while not message.endswith(b"\n"):
        message += connection.recv(1 << 20)
    request = json.loads(message)
    if not forkable(request["env"], started_with):
        connection.sendall(b"-\n")
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        connection.close()
        run_as_main(request, *fds)
    for fd in fds:
        os.close(fd)
    connection.sendall(f"{pid}\n".encode())
    ended = os.pidfd_open(pid)
    with selectors.DefaultSelector() as selector:
        selector.register(ended, selectors.EVENT_READ)
        selector.register(connection, selectors.EVENT_READ)
        while not any(key.fileobj is ended for key, _ in selector.select()):
            if not connection.recv(1):  # whoever asked is gone: so is its launch
                os.kill(pid, signal.SIGKILL)
                selector.unregister(connection)
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):
        connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)


def run_as_main(request, out_fd, err_fd):
    """Runs the script as the interpreter runs `python script args` (`python -u` if asked), and leaves the
    interpreter at its end: its exit status, an uncaught exception and the exit handlers are the
    interpreter's own."""
    import runpy

    null = os.open(os.devnull, os.O_RDONLY)
    for fd, std in ((null, 0), (out_fd, 1), (err_fd, 2)):
        os.dup2(fd, std)
        os.close(fd)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    out, err = (io.FileIO(fd, "w", closefd=False) for fd in (1, 2))
    buffered = not request.get("unbuffered")
    if buffered:
        out, err = io.BufferedWriter(out), io.BufferedWriter(err)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(out, write_through=not buffered)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        err, errors="backslashreplace", line_buffering=True, write_through=not buffered
    )
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["path"], *request["args"]]
    sys.path[:] = [os.path.dirname(request["path"])] + [p for p in sys.path if p not in (REPO, TESTS)]
    runpy.run_path(request["path"], run_name="__main__")
    sys.exit(0)


if __name__ == "__main__":
    import resource

    # the test that started the zygote may have lowered its own address-space limit (conftest's deadline)
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    started_with = dict(os.environ)  # before the imports, some of which set variables of their own
    preload()
    serve(sys.argv[1], started_with)
