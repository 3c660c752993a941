"""Checkpoints: <checkpoint_dir>/<run_name>/step_<N>/, written under a temporary name and renamed once every
rank has finished, so a folder named step_<N> is always complete. Its manifest.json holds a CRC-32 checksum
of every other file, checked before any tensor is loaded (files.py); an unusable checkpoint is named, set
aside (set_aside.py) and skipped for the one before it. The checksums find accidents; safe_load.py keeps a
deliberately changed file from running code, reading beyond its folder or loading another model's tensors."""

import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from common.errors import exit_after_the_speaker, fail
from run.checkpoint.files import MANIFEST, checkpoint_problem, file_checksum, plain_tensors, read_json
from run.checkpoint.safe_load import UnsafeFile, load_file, load_full, load_sharded
from run.checkpoint.schedule import CheckpointSchedule, benchmark_write_GBps
from run.checkpoint.set_aside import recorded, set_aside, set_aside_as_unusable, set_aside_unusable

# Options a checkpoint's optimizer and schedule carry values of, which a relaunch may change: the learning
# rate and its schedule, weight decay, clipping and the run's length (where the cosine decay ends).
RESUMED_OPTIONS = ("lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip", "max_steps", "num_epochs")
# run/model/step.py's build_optimizer puts the weights that decay in the first parameter group
DECAYED_GROUP = 0


def checkpoint_steps(run_dir):
    """Steps of the step_N folders of a run, oldest first (step_N.tmp folders are not complete)."""
    return sorted(int(m.group(1)) for name in os.listdir(run_dir) if (m := re.fullmatch(r"step_(\d+)", name)))


def newest_checkpoint(run_dir):
    steps = checkpoint_steps(run_dir)
    return os.path.join(run_dir, f"step_{steps[-1]}") if steps else None


def checkpoint_step(path):
    """The step a verified checkpoint was written at, whatever its folder is called now."""
    return read_json(os.path.join(path, "trainer_state.json"))["step"]


def model_and_optimizer_state(model, optimizer, full):
    state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=full))
    return plain_tensors(state)


def own_files(folder, rank):
    """The files of a checkpoint this rank wrote: its DCP shards and RNG file; rank 0 also the shared ones."""
    per_rank = re.compile(r"__(\d+)_\d+\.distcp|rank(\d+)\.pt")

    def own(name):
        match = per_rank.fullmatch(name)
        return str(rank) in match.groups() if match else rank == 0

    return sorted(name for name in os.listdir(folder) if name != MANIFEST and own(name))


def save_error(error):
    """One line for a failed write. DCP's CheckpointException holds each rank's error with its traceback."""
    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))[0]
    return " ".join(str(error).split()) or type(error).__name__


def space_left(path):
    try:
        return f"{shutil.disk_usage(path).free / 2**20:.0f} MiB free there"
    except OSError:
        return "free space unknown"


def save_errors():
    """What a failed write raises: OSError, RuntimeError from torch.save, CheckpointException (a
    BaseException) from DCP, SafetensorError from the export."""
    from safetensors import SafetensorError

    return OSError, RuntimeError, dcp.CheckpointException, SafetensorError


class Checkpointer:
    """Saves and restores everything an exact resume needs: model, optimizer, schedule, step, tokens
    seen, data position, RNG states and the config. Tensors go through torch.distributed.checkpoint;
    the rest is JSON and a small per-rank file of RNG states and data position. Loading unpickles nothing
    but plain data (run/checkpoint/safe_load.py)."""

    def __init__(self, args, shape, rank, world_size, n_params):
        self.args, self.shape, self.rank, self.world_size = args, shape, rank, world_size
        self.run_dir = os.path.join(args.checkpoint_dir, args.run_name)
        nodes = world_size // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        write_GBps = benchmark_write_GBps(rank == 0) if args.checkpoint_every == "auto" else None
        self.schedule = CheckpointSchedule(
            args.checkpoint_every, n_params, nodes, args.node_mtbf_hours, write_GBps
        )
        self.pending = None  # (future of (error, checksums), temporary folder, final folder) of an async save
        self.unpruned = None  # rank 0's newest save, whose older checkpoints wait for prune()
        # Background saves talk over their own group so they never interleave with training collectives.
        self.group = dist.new_group(backend="gloo") if args.async_checkpoint else None
        self.hasher = ThreadPoolExecutor(1) if args.async_checkpoint else None
        self.stager = None
        if args.async_checkpoint and torch.cuda.is_available():
            from torch.distributed.checkpoint.staging import BlockingAsyncStager

            # One pinned host copy of this rank's state, reused by every save (as torchtitan stages): the
            # device-to-host copy runs at full PCIe/C2C speed, and no save allocates host memory again.
            self.stager = BlockingAsyncStager(cache_staged_state_dict=True)

    def gather(self, value):
        values = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def checksums(self, temporary):
        """(None, this rank's files' checksums), or (the error, None)."""
        try:
            names = own_files(temporary, self.rank)
            return None, {name: file_checksum(os.path.join(temporary, name)) for name in names}
        except OSError as error:
            return save_error(error), None

    def written(self, future, temporary):
        """The outcome of a background save, then the checksums of its files: runs on the hasher thread."""
        try:
            future.result()
        except save_errors() as error:
            return save_error(error), None
        return self.checksums(temporary)

    def due(self, step, last=False):
        """Whether a save is due after step (last: the run's last step, or a stop was asked for)."""
        return self.schedule.due(step, last)

    def save(self, trainer_state, model, optimizer, scheduler, batches):
        """trainer_state: the step, tokens seen and time so far; the options and the shape are added. The time
        the save blocks training goes to the schedule."""
        started = time.perf_counter()
        self.finish()
        step = trainer_state["step"]
        final = os.path.join(self.run_dir, f"step_{step}")
        temporary = final + ".tmp"
        error = None
        if self.rank == 0:
            try:
                shutil.rmtree(temporary, ignore_errors=True)  # left by a save that was killed
                os.makedirs(temporary)
            except OSError as failure:
                error = save_error(failure)
        if problem := next(filter(None, self.gather(error)), None):
            self.abandon(temporary, problem)
        full = self.args.ckpt_format == "full"
        model_state, optimizer_state = model_and_optimizer_state(model, optimizer, full)
        state = {"model": model_state, "optimizer": optimizer_state}
        try:
            if full:
                if self.rank == 0:
                    torch.save(state, os.path.join(temporary, "state_dict.pt"))
            elif self.args.async_checkpoint:
                future = dcp.async_save(
                    state, checkpoint_id=temporary, process_group=self.group, async_stager=self.stager
                )
                self.pending = (self.hasher.submit(self.written, future, temporary), temporary, final)
            else:
                dcp.save(state, checkpoint_id=temporary)
            # RNG states are per rank; the data position is a stream's per rank, else one for the run, which
            # trainer_state.json keeps (readable, and the same at any world size).
            position, rank_file = batches.state_dict(), os.path.join(temporary, f"rank{self.rank}.pt")
            per_rank = {"data": position} if batches.position_per_rank else {}
            torch.save({"rng": rng_states(), **per_rank}, rank_file)
            if self.rank == 0:
                shape = {name: getattr(self.shape, name) for name in self.shape.names}
                family = self.shape.config_class.__name__
                trainer_state = dict(trainer_state, config=vars(self.args), family=family, shape=shape)
                trainer_state.update(corpus=batches.corpus)
                if not batches.position_per_rank:
                    trainer_state.update(data=position)
                trainer_state.update(scheduler=scheduler.state_dict(), world_size=self.world_size)
                with open(os.path.join(temporary, "trainer_state.json"), "w") as f:
                    json.dump(trainer_state, f, indent=1)
        except save_errors() as failure:
            error = save_error(failure)
        if self.pending is None:
            self.publish(temporary, final, (error, None) if error else self.checksums(temporary))
        elif problem := next(filter(None, self.gather(error)), None):
            self.abandon(temporary, problem)
        self.schedule.saved(step, time.perf_counter() - started)

    def finish(self):
        """Waits for a background save and its checksums, then publishes it."""
        if self.pending is not None:
            outcome, temporary, final = self.pending
            self.pending = None
            self.publish(temporary, final, outcome.result())

    def publish(self, temporary, final, outcome):
        """outcome: this rank's (error, checksums). Rank 0 writes the manifest of every rank's files, then
        renames the folder: a step_N folder with a manifest is complete."""
        outcomes = self.gather(outcome)
        problem = next((error for error, _ in outcomes if error), None)
        if problem is None and self.rank == 0:
            try:
                files = {name: checksum for _, checksums in outcomes for name, checksum in checksums.items()}
                with open(os.path.join(temporary, MANIFEST), "w") as f:
                    json.dump({"files": files}, f, indent=1)
                shutil.rmtree(final, ignore_errors=True)
                os.rename(temporary, final)
            except OSError as error:
                problem = save_error(error)
            else:
                self.unpruned = int(final.rsplit("_", 1)[1])
                print(f"checkpoint saved: {final}", flush=True)
        verdict = [problem]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            self.abandon(temporary, verdict[0])

    def prune(self):
        """Keeps the newest keep_last checkpoints: the newest save and those before it, once a finite step
        after it, or the run's end, has shown its weights sound; a non-finite one sets it aside
        (run/health/non_finite.py), and those before it are still there. A later step is no older checkpoint
        of this line (one that could not be resumed), and is never removed here."""
        step, self.unpruned = self.unpruned, None
        if step is not None and self.args.keep_last:
            older = [old for old in checkpoint_steps(self.run_dir) if old < step]
            for old in older[: max(0, len(older) - self.args.keep_last + 1)]:
                shutil.rmtree(os.path.join(self.run_dir, f"step_{old}"), ignore_errors=True)

    def abandon(self, temporary, problem):
        """Every rank comes here together: removes the folder of the failed save and exits, rank 0 naming
        the cause and the checkpoint that is kept."""
        if self.pending is not None:
            self.pending[0].result()  # the background writer must be done before its folder goes
            self.pending = None
        if self.rank != 0:
            exit_after_the_speaker()
        shutil.rmtree(temporary, ignore_errors=True)
        previous = newest_checkpoint(self.run_dir)
        kept = (
            f"the previous checkpoint {previous} is untouched"
            if previous
            else "there is no earlier checkpoint"
        )
        fail(
            f"writing checkpoint {temporary} failed ({problem}; {space_left(self.run_dir)}); {kept}. "
            f"Free space or fix permissions, then relaunch"
        )

    def problem(self, path, model):
        """The first problem any rank finds in its share of the checkpoint's files, or None. Its tensors are
        compared with the model's unless its trainer state records another model: load refuses that one,
        naming the family or shape, and the run does not fall back past the user's change."""
        model = model if self.records_this_model(path) else None
        problem = checkpoint_problem(path, self.rank, self.world_size, model)
        return next(filter(None, self.gather(problem)), None)

    def choose(self, resume_from, model):
        """The checkpoint to resume from: resume_from, else the newest of the run; one that is incomplete,
        corrupt, or holds tensors other than the model's (given on the meta device) is skipped for the one
        before it. None for a fresh run; exit 2 if none is usable."""
        if resume_from:
            resume_from = self.rewind(os.path.normpath(resume_from))
        run_dir = os.path.dirname(resume_from) or "." if resume_from else self.run_dir
        steps = reversed(checkpoint_steps(run_dir))
        candidates = [os.path.normpath(os.path.join(run_dir, f"step_{step}")) for step in steps]
        if resume_from:
            newest = os.path.normpath(resume_from)
            older = candidates[candidates.index(newest) + 1 :] if newest in candidates else []
            candidates = [newest] + older
        passed = []  # the unusable checkpoints passed over, with their problems
        for path in candidates:
            if (problem := self.problem(path, model)) is None:
                self.pass_over(passed, path)
                return path
            passed.append((path, problem))
        for (path, problem), following in zip(passed, [*candidates[1:], None]):
            following = f"falling back to {following}" if following else "no earlier checkpoint is left"
            self.warn(f"checkpoint {path} is unusable: {problem}; {following}")
        if candidates:
            message = (
                f"no usable checkpoint to resume from ({', '.join(candidates)}); delete them to start "
                f"over, or set another --run_name"
            )
            self.refuse(message)
        return None

    def pass_over(self, passed, usable):
        """The unusable checkpoints a resume passes over for usable, each said in a warning. Those of this run
        are first set aside in <run>/unusable_<time>/ (set_aside.py), never removed: the save of their step
        would replace them. Another run's checkpoints (--resume_from) are only read."""
        own = [path for path, _ in passed if self.of_this_run(path)]
        moved = [set_aside_unusable(self.run_dir, own) if self.rank == 0 and own else None]
        if own:
            dist.broadcast_object_list(moved, src=0)
            if isinstance(moved[0], str):
                self.refuse(moved[0])
        for (path, problem), following in zip(passed, [*(path for path, _ in passed[1:]), usable]):
            where = f"set aside as {moved[0][path]}; " if path in own else ""
            self.warn(f"checkpoint {path} is unusable: {problem}; {where}falling back to {following}")

    def warn(self, line):
        if self.rank == 0:
            print(f"warning: {line}", flush=True)

    def of_this_run(self, path):
        """Whether path is a step_N folder of this run's, which its saves may replace."""
        in_run = os.path.abspath(os.path.dirname(path)) == os.path.abspath(self.run_dir)
        return in_run and re.fullmatch(r"step_\d+", os.path.basename(path)) is not None

    def rewind(self, resume_from):
        """--resume_from=<this run>/step_K with later checkpoints: the run is rewound to step K. Its later
        checkpoints, the old future, are set aside (moved into <run>/rewound_<time>/, never removed, never
        resumed from) and the rewind recorded (run/checkpoint/set_aside.py), so that the run keeps one line of
        checkpoints. A launch of the same command once that line has gone on (a requeued job), or naming a
        checkpoint an earlier launch set aside as unusable, continues it: returns None, the newest checkpoint
        of the run, instead of rewinding again. A checkpoint of another run is only read (a branch into this
        run)."""
        if not self.of_this_run(resume_from):
            return resume_from
        step = re.fullmatch(r"step_(\d+)", os.path.basename(resume_from))
        decision = [self.rewind_run(resume_from, int(step.group(1))) if self.rank == 0 else None]
        dist.broadcast_object_list(decision, src=0)  # one rank decides and moves; every rank then sees it
        return decision[0]

    def rewind_run(self, resume_from, step):
        if any(rewind.get("to") == step for rewind in recorded(self.run_dir)):
            print(f"{resume_from}: this run was rewound to it before; continuing from its newest checkpoint")
            return None
        if set_aside_as_unusable(self.run_dir, f"step_{step}"):
            print(f"{resume_from}: an earlier launch found it unusable and set it aside; continuing from "
                  f"this run's newest checkpoint", flush=True)  # fmt: skip
            return None
        later = [f"step_{s}" for s in checkpoint_steps(self.run_dir) if s > step]
        if later:
            aside = set_aside(self.run_dir, later, "rewound", to=step)
            names = ", ".join(later)
            print(f"rewinding run {self.run_dir} to step {step}: its later checkpoints ({names}) are set "
                  f"aside in {aside}", flush=True)  # fmt: skip
        return resume_from

    def refuse(self, message):
        """Every rank finds the same problem with a checkpoint; rank 0 says it."""
        fail(message) if self.rank == 0 else exit_after_the_speaker()

    def another_model(self, path, trainer_state):
        """The line that refuses a checkpoint whose trainer state records another model family or shape, or
        None."""
        family, saved_family = self.shape.config_class.__name__, trainer_state.get("family", "")
        if saved_family and saved_family != family:
            return (
                f"checkpoint {path} holds a {saved_family} model, and this run builds a {family} one "
                f"(--model={self.args.model}); use another --run_name or --checkpoint_dir"
            )
        recorded = trainer_state["shape"]
        changed = {k: (v, getattr(self.shape, k)) for k, v in recorded.items() if getattr(self.shape, k) != v}
        if changed:
            details = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items())
            return (
                f"checkpoint {path} has another model shape ({details}); use another --run_name or "
                f"--checkpoint_dir"
            )
        return None

    def records_this_model(self, path):
        """Whether the checkpoint's trainer state records this run's model family and shape; also when it is
        unreadable, which checkpoint_problem names."""
        try:
            return self.another_model(path, read_json(os.path.join(path, "trainer_state.json"))) is None
        except (OSError, UnsafeFile, ValueError, KeyError, TypeError, AttributeError):
            return True

    def refuse_another_run(self, path, trainer_state):
        """A checkpoint of another model family or shape, or of real data read in windows of another length,
        is refused in one line."""
        if message := self.another_model(path, trainer_state):
            self.refuse(message)
        windows = trainer_state.get("config", {}).get("seq_length")
        if self.args.data != "dummy" and windows and windows != self.args.seq_length:
            self.refuse(  # the data position counts windows: another length would repeat text and skip other
                f"checkpoint {path} read --data={self.args.data} in windows of --seq_length={windows}, and "
                f"its data position counts those windows; resume with --seq_length={windows}, or start "
                f"another --run_name"
            )

    def refuse_another_corpus(self, path, saved, corpus):
        """A checkpoint whose data position counts windows of other tokens than --data holds now (the corpus
        grew or changed, and was prepared anew) is refused: the position would point into other text. The
        tokens' digest decides, so a corpus only touched or copied, which tokenises the same, resumes."""
        if not corpus or not isinstance(saved, dict) or saved.get("blake2b") == corpus["blake2b"]:
            return
        then = saved.get("tokens")
        then = f"{then:,}" if isinstance(then, int) else "?"
        now = f"{corpus['tokens']:,}" if corpus["tokens"] != saved.get("tokens") else "as many, but others"
        self.refuse(
            f"checkpoint {path} read --data={self.args.data} as {then} training tokens "
            f"({saved.get('prepared')}), and it now holds {now} ({corpus['prepared']}): the corpus "
            f"changed, and the checkpoint's data position counts windows of the old tokens; resume with the "
            f"corpus as it was, or start another --run_name"
        )

    def load_safely(self, load, *args, **kwargs):
        """A file that checkpoint_problem let through and that still holds more than plain data: its
        tensors are checked only as they load. Every rank reads the shared files, so every rank refuses."""
        try:
            return load(*args, **kwargs)
        except UnsafeFile as error:
            self.refuse(f"not resuming: {error}")

    def state_to_load(self, model, optimizer):
        """The model's and, unless --skip_optimizer, the optimizer's state, sharded, as save names them."""
        model_state, optimizer_state = model_and_optimizer_state(model, optimizer, full=False)
        if self.args.skip_optimizer:
            return {"model": model_state}
        return {"model": model_state, "optimizer": optimizer_state}

    def load(self, path, model, optimizer, scheduler, batches):
        """Restores a checkpoint written by save(); returns its trainer state."""
        with open(os.path.join(path, "trainer_state.json")) as f:
            trainer_state = json.load(f)
        self.refuse_another_run(path, trainer_state)
        self.refuse_another_corpus(path, trainer_state.get("corpus"), batches.corpus)
        self.schedule.resumed(trainer_state["step"])
        full_file = os.path.join(path, "state_dict.pt")
        full = os.path.exists(full_file)
        if full:  # only if its tensors are those of the model and optimizer, by name and shape
            state = self.load_safely(load_full, full_file, self.state_to_load(model, optimizer))
        else:
            state = self.state_to_load(model, optimizer)
            self.load_safely(load_sharded, state, path)
        options = StateDictOptions(full_state_dict=full)
        if self.args.skip_optimizer:  # fresh optimizer; this run's schedule, at the resumed step
            set_model_state_dict(model, state["model"], options=options)
            scheduler.last_epoch = trainer_state["step"] - 1
            scheduler.step()
        else:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=options,
            )
            scheduler.load_state_dict(trainer_state["scheduler"])
            self.apply_changed_options(trainer_state.get("config", {}), optimizer, scheduler)
        same_world = trainer_state["world_size"] == self.world_size
        if same_world:  # another world size's ranks drew other random numbers: theirs do not carry over
            rank_state = self.load_safely(load_file, os.path.join(path, f"rank{self.rank}.pt"))
            restore_rng_states(rank_state["rng"])
        if not batches.position_per_rank:  # window positions do not depend on the world size
            batches.load_state_dict(trainer_state["data"])
        elif same_world:
            batches.load_state_dict(rank_state["data"])
        else:
            writers = trainer_state["world_size"]
            self.refuse(
                f"checkpoint {path} of a streamed run was written by {writers} processes: "
                f"a stream's position cannot be split anew, so resume it with {writers}"
            )
        return trainer_state

    def apply_changed_options(self, saved, optimizer, scheduler):
        """The relaunch's --lr and --weight_decay replace the values the checkpoint's optimizer and schedule
        restored; the rest of the schedule and clipping are read from the options at every step already.
        One line names each option of RESUMED_OPTIONS that changed: a relaunch does what its command says."""
        changed = {name: (saved[name], getattr(self.args, name)) for name in RESUMED_OPTIONS
                   if name in saved and saved[name] != getattr(self.args, name)}  # fmt: skip
        if not changed:
            return
        scheduler.base_lrs = [self.args.lr] * len(optimizer.param_groups)
        for index, (group, factor) in enumerate(zip(optimizer.param_groups, scheduler.lr_lambdas)):
            group["initial_lr"], group["lr"] = self.args.lr, self.args.lr * factor(scheduler.last_epoch)
            if index == DECAYED_GROUP:
                group["weight_decay"] = self.args.weight_decay
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
        if self.rank == 0:
            changes = ", ".join(f"--{name} {old} -> {new}" for name, (old, new) in changed.items())
            print(f"options changed since the checkpoint, applied from here on: {changes}", flush=True)


def rng_states():
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def restore_rng_states(states):
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
