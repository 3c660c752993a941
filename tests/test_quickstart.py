"""The README's first command, as a user runs it on a machine without SLURM or GPUs: its folders given on the
command line, so that the test writes only under its temporary folder."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import REPO, worker_pids


def test_quick_start_trains_tiny_on_two_cpu_processes_and_the_loss_falls(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["BENCHMARK_ARGS"] = f"--report_dir={tmp_path}/reports --storage_path={tmp_path}"
    folders = [f"--log_dir={tmp_path}/logs", f"--checkpoint_dir={tmp_path}/checkpoints"]
    result = subprocess.run(
        ["bash", "slurm_submit.sh", *folders], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "phase 1: benchmark.py --quick" in result.stdout
    # one node: no peers for the CPU figures; a slow rank in a collective would warn and training goes on
    verdict = re.search(r"^verdict: (pass|warn) in .*; report: (\S+);", result.stdout, re.MULTILINE)
    assert verdict and verdict.group(2).startswith(f"{tmp_path}/reports/benchmark_"), result.stdout[-3000:]
    assert "world_size=2" in result.stdout
    losses = [float(loss) for loss in re.findall(r"^step +\d+/\d+ \| loss ([\d.]+)", result.stdout, re.M)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 1.0, losses
    assert "On a GPU cluster: sbatch slurm_submit.sh" in result.stdout
    # the job counted its benchmark phase in the run's time
    ledger = next((tmp_path / "logs").glob("quickstart-*/goodput.json")).read_text()
    assert re.search(r'"benchmark_s": [1-9]', ledger), ledger


# A command as a terminal starts it: SIGINT, SIGQUIT and SIGHUP at their defaults. The test process may have
# inherited them ignored (a non-interactive shell starts a background command with SIGINT and SIGQUIT
# ignored), and the job leaves a stop signal ignored that it started with ignored, as nohup's user expects.
AS_FROM_A_TERMINAL = [
    sys.executable,
    "-c",
    "import os, signal, sys\n"
    "for number in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):\n"
    "    signal.signal(number, signal.SIG_DFL)\n"
    "os.execvp(sys.argv[1], sys.argv[1:])",
]


class QuickStart:
    """bash slurm_submit.sh as a user starts it from a terminal: in a process group of its own, which the
    terminal's Ctrl-C goes to. No benchmark, and steps enough that only a stop ends it."""

    def __init__(self, tmp_path, *args):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"SKIP_BENCHMARK": "1"}
        command = [*AS_FROM_A_TERMINAL, "bash", "slurm_submit.sh", f"--log_dir={tmp_path}/logs",
                   f"--checkpoint_dir={tmp_path}/ckpt", "--max_steps=100000", "--log_every=1",
                   "--predict=False", *args]  # fmt: skip
        self.job = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.tmp_path, self.lines = tmp_path, []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.job.stdout), daemon=True)
        self.reader.start()

    def wait_for(self, pattern, after=0, timeout=300):
        """The index of the first line from lines[after:] that matches pattern, once it is there."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for index in range(after, len(self.lines)):
                if re.search(pattern, self.lines[index]):
                    return index
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r} in {timeout} s:\n{''.join(self.lines)[-3000:]}")

    def torchrun(self):
        (pid,) = Path(f"/proc/{self.job.pid}/task/{self.job.pid}/children").read_text().split()
        return int(pid)

    def ended(self, timeout=180):
        """The job's exit status and output, once it has exited; no process of its run is left."""
        try:
            status = self.job.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the job did not end in {timeout} s; {self.state()}\n{''.join(self.lines)[-3000:]}"
            ) from None
        finally:
            left = self.processes()
            for pid in left:
                os.kill(pid, signal.SIGKILL)
        self.reader.join(timeout=60)
        assert not left, f"processes left running: {left}\n{''.join(self.lines)[-3000:]}"
        return status, "".join(self.lines)

    def state(self):
        """What the job's process was doing: its signals (pending, blocked, ignored, caught) and where each of
        its threads waited in the kernel."""
        proc = Path(f"/proc/{self.job.pid}")
        with contextlib.suppress(OSError):
            signals = [
                line for line in (proc / "status").read_text().splitlines() if line.startswith(("Sig", "Shd"))
            ]
            waits = [(task / "wchan").read_text() for task in sorted((proc / "task").iterdir())]
            signals = " ".join(" ".join(line.split()) for line in signals)
            return f"job {self.job.pid}: {signals}; its threads wait in {waits}"
        return f"job {self.job.pid}: gone"

    def processes(self):
        """The processes of this run still there: the job, torchrun, the workers."""
        mine = []
        for proc in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                if str(self.tmp_path).encode() in (proc / "cmdline").read_bytes():
                    mine.append(int(proc.name))
        return mine


def stopped_once(output):
    """The one step the run stopped after, saying so once, with its checkpoint saved once."""
    stops = re.findall(r"^stopped by signal after step (\d+)", output, re.M)
    assert len(stops) == 1 and output.count("checkpoint saved: ") == 1, output[-3000:]
    return int(stops[0])


def test_sigterm_to_the_job_after_a_crash_ends_it_once_saved_and_a_crash_restarts_in_place(tmp_path):
    """A rank SIGKILLed mid-run is a crash: training restarts in place. Then `kill <pid>` of the job: the job
    passes the SIGTERM on, the workers checkpoint, and the job ends in one line, with no restart."""
    quick = QuickStart(tmp_path)
    quick.wait_for(r"^step +3/")
    os.kill(worker_pids(quick.torchrun())[1], signal.SIGKILL)
    restarted = quick.wait_for(r"restarting in place on \S+ \(no check \(SKIP_BENCHMARK=1\)\): restart 1 of")
    quick.wait_for(r"^step +3/", after=restarted)
    os.kill(quick.job.pid, signal.SIGTERM)
    status, output = quick.ended()
    assert status == 143, output[-3000:]
    step = stopped_once(output)
    assert output.count("phase 2: train.py") == 2 and output.count("restarting in place") == 1, output[-3000:]
    assert re.search(
        r"^\d\d:\d\d:\d\d stopped by SIGTERM: training exited \(status \d+\) and is not restarted; "
        r"to resume, launch again with --run_name=quickstart-\S+$",
        output.splitlines()[-1],
    ), output[-3000:]
    assert [path.name for path in (tmp_path / "ckpt").glob("*/step_*")] == [f"step_{step}"]


def test_ctrl_c_ends_the_quick_start_once_saved_with_no_restart(tmp_path):
    """Ctrl-C: SIGINT to the terminal's process group, the job's; torchrun, in a session of its own, gets it
    from the job, once."""
    quick = QuickStart(tmp_path, "--run_name=ctrl-c")
    quick.wait_for(r"^step +3/")
    os.killpg(quick.job.pid, signal.SIGINT)
    status, output = quick.ended()
    assert status == 130, output[-3000:]
    step = stopped_once(output)
    assert output.count("phase 2: train.py") == 1 and "KeyboardInterrupt" not in output, output[-3000:]
    assert output.splitlines()[-1].endswith(
        "stopped by SIGINT: training exited (status 1) and is not restarted; to resume, launch again with "
        "--run_name=ctrl-c"
    ), output[-3000:]
    assert [path.name for path in (tmp_path / "ckpt" / "ctrl-c").glob("step_*")] == [f"step_{step}"]


def test_sigterm_to_torchrun_alone_ends_the_quick_start_once_saved_with_no_restart(tmp_path):
    """The training processes' own stop, which the job never got: rank 0 says so once saved."""
    quick = QuickStart(tmp_path, "--run_name=torchrun")
    quick.wait_for(r"^step +3/")
    os.kill(quick.torchrun(), signal.SIGTERM)
    status, output = quick.ended()
    step = stopped_once(output)
    assert status == 1 and output.count("phase 2: train.py") == 1, output[-3000:]
    assert output.splitlines()[-1].endswith(
        "stopped by a stop signal to the training processes: training exited (status 1) and is not "
        "restarted; to resume, launch again with --run_name=torchrun"
    ), output[-3000:]
    assert [path.name for path in (tmp_path / "ckpt" / "torchrun").glob("step_*")] == [f"step_{step}"]


def test_sigusr1_to_the_quick_start_checkpoints_and_says_how_to_resume(tmp_path):
    """SLURM's time-limit warning, outside SLURM: the run checkpoints, and with no job to requeue the job
    says how to resume."""
    quick = QuickStart(tmp_path, "--run_name=usr1")
    quick.wait_for(r"^step +3/")
    os.kill(quick.job.pid, signal.SIGUSR1)
    status, output = quick.ended()
    stopped_once(output)
    assert "SIGUSR1: time limit near, checkpointing to requeue" in output and status == 1, output[-3000:]
    assert (
        "stopped and not requeued: not in a SLURM job: nothing to requeue; to resume, launch again with "
        "--run_name=usr1" in output
    ), output[-3000:]
    assert output.count("phase 2: train.py") == 1 and "restarting in place" not in output, output[-3000:]
