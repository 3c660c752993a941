"""The job's scheduler: every call the job makes to srun, scontrol and squeue goes through Slurm, and Local
stands in for it outside a SLURM job (one node, this machine). Tests drive the job through a fake with the
same methods (tests/fake_scheduler.py). Standard library only: a job run in a container starts this with
the host's python3."""

import os
import re
import signal
import socket
import subprocess
import time


def duration_s(text):
    """Seconds of a duration as scontrol shows it, [days-]hours:minutes:seconds; None for UNLIMITED."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d+):(\d+)", text)
    if not match:
        return None
    days, hours, minutes, seconds = (int(part or 0) for part in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


# sinfo's short node states (%t) of a node no job will start on until someone acts
UNUSABLE = ("down", "drain", "drng", "fail", "futr", "inval", "maint", "unk")


class Local:
    """No SLURM job: this machine is the one node, launches are torchrun --standalone, nothing requeues."""

    job_id, restarts, in_job = None, 0, False

    def hostnames(self):
        return [socket.gethostname()]

    def comment(self):
        return ""

    def time_left_s(self):
        """(seconds left, the time limit in seconds), or None: no limit."""
        return None

    def torchrun(self, python, nodes, nproc):
        """torchrun restarts nothing itself: the job does, choosing the nodes (run/job/job.py)."""
        return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                "--max-restarts=0"]  # fmt: skip

    def start(self, nodes, command, env):
        """A launch; its stderr is a pipe the job reads (run/job/launch.py). It runs in a session of its own,
        so that a signal to the job's process group (Ctrl-C, kill -- -PGID) reaches the job alone, which
        passes it on once (run/job/job.py): torchrun, given it twice, passes the second on to its workers, who
        take a second signal for one that exits at once, writing nothing."""
        return subprocess.Popen(command, env=env, stderr=subprocess.PIPE, start_new_session=True)

    def check(self, node, command, env, container_image):
        """Runs a script's check of its options (train.py's, benchmark.py's) here; returns its exit status."""
        return subprocess.run(command, env=env).returncode

    def end(self, process):
        """Ends a launch whose node froze: SIGINT, and a second one, which srun answers with SIGKILL."""
        process.send_signal(signal.SIGINT)
        time.sleep(0.2)
        if process.poll() is None:
            process.send_signal(signal.SIGINT)

    def requeue(self):
        return "not in a SLURM job: nothing to requeue"


class Slurm(Local):
    """The running job (SLURM_JOB_ID). Methods that change the job return None when SLURM agreed, else the
    reason it gave."""

    in_job = True

    def __init__(self, environ, container_image=""):
        self.job_id, self.environ = environ["SLURM_JOB_ID"], environ
        self.restarts = int(environ.get("SLURM_RESTART_COUNT") or 0)
        # --cpus-per-task: srun (22.05+) no longer inherits it, and one CPU would starve the data loaders.
        # --kill-on-bad-exit=0 (some clusters default to 1): every rank exits 75 after a checkpoint, and the
        # first node to finish must not kill the others while they still write theirs.
        self.srun = ["srun", "--ntasks-per-node=1", f"--cpus-per-task={environ.get('SLURM_CPUS_ON_NODE', 1)}",
                     "--kill-on-bad-exit=0"]  # fmt: skip
        if container_image:
            here = os.getcwd()
            self.srun += [f"--container-image={container_image}", f"--container-mounts={here}:{here}",
                          f"--container-workdir={here}"]  # fmt: skip

    def call(self, *command):
        """Runs scontrol or squeue; returns (exit status, its output or its error)."""
        done = subprocess.run(command, capture_output=True, text=True)
        return done.returncode, (done.stdout if done.returncode == 0 else done.stderr).strip()

    def hostnames(self):
        status, out = self.call("scontrol", "show", "hostnames", self.environ["SLURM_JOB_NODELIST"])
        return out.split() if status == 0 else []

    def fields(self):
        """The job's fields as scontrol shows them (no accounting needed)."""
        status, out = self.call("scontrol", "-o", "show", "job", self.job_id)
        return dict(re.findall(r"(\w+)=(\S*)", out)) if status == 0 else {}

    def comment(self):
        status, out = self.call("squeue", "-h", "-j", self.job_id, "-o", "%k")
        return "" if status != 0 or out == "(null)" else out

    def set_comment(self, text):
        status, out = self.call("scontrol", "update", f"JobId={self.job_id}", f"Comment={text}")
        return None if status == 0 else out

    def excluded(self):
        """The nodes this job may not be given (its ExcNodeList), as SLURM writes them."""
        value = self.fields().get("ExcNodeList", "(null)")
        return "" if value.startswith("(null)") else value

    def exclude(self, nodes):
        status, out = self.call("scontrol", "update", f"JobId={self.job_id}", f"ExcNodeList={nodes}")
        return None if status == 0 else out

    def requeue(self):
        status, out = self.call("scontrol", "requeue", self.job_id)
        return None if status == 0 else f"{out} (was the job submitted with --no-requeue?)"

    def time_left_s(self):
        fields = self.fields()
        limit, ran = duration_s(fields.get("TimeLimit", "")), duration_s(fields.get("RunTime", ""))
        return None if limit is None or ran is None else (limit - ran, limit)

    def torchrun(self, python, nodes, nproc):
        # The port comes from the job id, so that two jobs sharing a node do not collide, and lies below the
        # kernel's ephemeral ports (32768 and up), one of which an outgoing connection may hold on nodes[0].
        port = 10000 + int(self.job_id) % 20000
        return [python, "-m", "torch.distributed.run", f"--nnodes={len(nodes)}", f"--nproc_per_node={nproc}",
                "--rdzv_backend=c10d", f"--rdzv_endpoint={nodes[0]}:{port}", f"--rdzv_id={self.job_id}",
                "--max-restarts=0"]  # fmt: skip

    def start(self, nodes, command, env):
        where = [f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}"]
        return subprocess.Popen([*self.srun, *where, *command], env=env, stderr=subprocess.PIPE)

    def partition_nodes(self):
        """The nodes of the job's partitions that can run it now or later, by name: down, drained, failed,
        future and unresponsive ones (state*) left out. None when sinfo does not answer."""
        partition = self.fields().get("Partition", "")
        status, out = self.call("sinfo", "-h", "-N", "-p", partition, "-o", "%N %t")
        if status != 0 or not partition:
            return None
        nodes = [line.split() for line in out.splitlines() if len(line.split()) == 2]
        usable = [name for name, state in nodes if not state.endswith("*") and not state.startswith(UNUSABLE)]
        return list(dict.fromkeys(usable))  # a node of two partitions is listed twice

    def check(self, node, command, env, container_image):
        """Runs a script's check of its options on node when only the container has its Python, else here."""
        if container_image:
            command = [*self.srun, "--nodes=1", "--ntasks=1", f"--nodelist={node}", *command]
        return subprocess.run(command, env=env).returncode


def comment_value(comment, key):
    """The value of key=value in a job's comment, where the job keeps what its next start must know; None
    when it has none."""
    match = re.search(rf"(?:^| ){re.escape(key)}=(\S+)", comment)
    return match.group(1) if match else None


def with_comment_value(comment, key, value):
    """The comment, its key=value replaced by value (the rest of it, the user's own text, kept)."""
    kept = re.sub(rf"(?:^| ){re.escape(key)}=\S+", "", comment).strip()
    return f"{kept} {key}={value}".strip()


def left_out(comment):
    """The nodes a job's comment says it left out before (left_out=n1,n2)."""
    nodes = comment_value(comment, "left_out")
    return nodes.split(",") if nodes else []


def with_left_out(comment, nodes):
    """The comment, its left_out= replaced by nodes."""
    return with_comment_value(comment, "left_out", ",".join(nodes))


def scheduler(environ=os.environ, container_image=""):
    """Slurm inside a job, Local outside."""
    return Slurm(environ, container_image) if environ.get("SLURM_JOB_ID") else Local()
