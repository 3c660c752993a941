"""Single-process launches of the scripts (train.py, benchmark.py, sample.py) forked from a process that has
imported them already: a launch then starts in milliseconds instead of the 4-5 s of CPU a new interpreter
takes to import torch and transformers, which was most of the suite's CPU (measured: one record per
process of a whole run of the suite).

The process forked from is a zygote: a new interpreter, started once per test process with the test
process's environment, that imports the scripts' modules and runs nothing else (no test, no torch
operation, no thread pool). Each launch is a fork of it that runs the script as `python script.py args`
would: as __main__, from its own folder, with its own arguments, folder, environment and output pipes, and
exits through the interpreter's own exit. A launch whose environment differs from the zygote's in what a
library reads as it is imported (threads, kernels, caches, hub and W&B folders, HOME) starts a new
interpreter instead (forkable).

Run as a script, this file is the zygote: `python tests/forked.py SOCKET`."""

import atexit
import io
import json
import os
import selectors
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
# import (pytest names the test it is in)
FORKABLE_ENV = ("SLURM_", "SLURMD_NODENAME", "MASTER_PORT", "BENCHMARK_REPORT", "REHEARSE_BAD_NODES",
                "PYTEST_CURRENT_TEST")  # fmt: skip

_zygote = {}
_zygote_lock = threading.Lock()


def forkable(env):
    """Whether a launch with this whole environment can be a fork of this process's zygote."""
    started_with = _zygote.get("env", os.environ)
    changed = {name for name in env.keys() | started_with.keys() if env.get(name) != started_with.get(name)}
    return all(name.startswith(FORKABLE_ENV) for name in changed)


def zygote_address():
    with _zygote_lock:
        if "address" not in _zygote:
            folder = tempfile.mkdtemp(prefix="zygote-")
            address = os.path.join(folder, "socket")
            process = subprocess.Popen(
                [sys.executable, __file__, address], stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
            if process.stdout.readline() != b"ready\n":
                raise RuntimeError(f"the launch zygote did not start (status {process.wait()})")
            atexit.register(process.stdin.close)  # the zygote exits at its end of file
            _zygote.update(address=address, env=dict(os.environ), process=process)
        return _zygote["address"]


def run_script(path, args, cwd, env, timeout):
    """`python path *args` in cwd with the environment env, forked from the zygote; a
    subprocess.CompletedProcess with its text output, or subprocess.TimeoutExpired, as subprocess.run."""
    address = zygote_address()
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    request = json.dumps({"path": str(path), "args": args, "cwd": str(cwd), "env": env}).encode() + b"\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(address)
        socket.send_fds(connection, [request], [out_write, err_write])
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


def serve(address):
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
                watch(connection)
            connection.close()
    os.unlink(address)
    os.rmdir(os.path.dirname(address))
    os._exit(0)  # nothing to tear down


def watch(connection):
    """A watcher: forks the launch, tells its pid, waits for it and tells its exit status. In the launch this
    returns, to run the script."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
    while not message.endswith(b"\n"):
        message += connection.recv(1 << 20)
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        connection.close()
        run_as_main(request, *fds)
    for fd in fds:
        os.close(fd)
    connection.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)


def run_as_main(request, out_fd, err_fd):
    """Runs the script as the interpreter runs `python script args`, and leaves the interpreter at its end:
    its exit status, an uncaught exception and the exit handlers are the interpreter's own."""
    import runpy

    null = os.open(os.devnull, os.O_RDONLY)
    for fd, std in ((null, 0), (out_fd, 1), (err_fd, 2)):
        os.dup2(fd, std)
        os.close(fd)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)))
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)), errors="backslashreplace", line_buffering=True
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
    preload()
    serve(sys.argv[1])
