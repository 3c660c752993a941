"""How the project writes files: whole or not at all (under a temporary name in the same folder, then renamed
into place, so that a reader never sees half a file and a crash leaves no torn one), and only under the
folders a user named, libraries' caches included. And how it reads the files it keeps and the files a user
names: regular files alone, of a bounded size, so that nothing put in their place (a FIFO, a link to
/dev/zero, a folder) can hang a reader or fill its memory. Standard library only: the job runs it too."""

import contextlib
import json
import os
import pathlib
import secrets
import stat
import time

# A record a run keeps or its job reads (plan.json, a heartbeat, recovery.json, the goodput ledger, a config
# file) holds kilobytes: a megabyte is far more than any holds, and all a file in its place can make a
# reader take.
RECORD_LIMIT = 1 << 20

KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
}


class UnsafeFile(Exception):
    """A file refused before it is read or loaded: not a regular file, larger than any of its kind, or
    (run/checkpoint/safe_load.py) one that would run code, read beyond its folder, or load another model's
    tensors."""


def open_regular(path):
    """path opened for reading if it is a regular file: a FIFO would block the read forever, a device never
    end (/dev/zero), a link lead out of the folder. Its kind is checked before it is opened (lstat) and again
    on what was opened (fstat), so that a file swapped in between is refused too; it is opened without
    following a link and without blocking (opening a FIFO waits for a writer)."""
    refuse_irregular(path, os.lstat(path).st_mode)
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        refuse_irregular(path, os.fstat(descriptor).st_mode)
    except UnsafeFile:
        os.close(descriptor)
        raise
    return os.fdopen(descriptor, "rb")


def refuse_irregular(path, mode):
    if not stat.S_ISREG(mode):
        raise UnsafeFile(f"{path} is {KINDS.get(stat.S_IFMT(mode), 'not a file')}, not a regular file")


def read_regular(path, limit=RECORD_LIMIT):
    """The bytes of path, a regular file (open_regular) of at most limit bytes, else UnsafeFile; no more than
    limit bytes are read of a larger one, or of one that grows as it is read. A missing file is
    FileNotFoundError, as for open()."""
    with open_regular(path) as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise UnsafeFile(f"{path} holds more than {limit:,} bytes, more than any of its kind")
    return data


def read_json(path, limit=RECORD_LIMIT):
    """The JSON document in path, read as read_regular reads it; ValueError for one that is not JSON, nested
    past what json reads included."""
    data = read_regular(path, limit)
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("it is nested deeper than JSON is read") from None


def set_aside_damaged(path):
    """Moves a damaged file out of the way, beside it as <name>.damaged_<time><suffix>, so that what is
    written in its place does not meet it and it is kept to look at; says where it went."""
    stem, suffix = os.path.splitext(path)
    aside = f"{stem}.damaged_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}{suffix}"
    try:
        os.rename(path, aside)
    except OSError:
        return "left as it is"
    return f"set aside as {aside}"


def make_folders(path):
    """Creates path and the folders above it that are missing; returns those it created, outermost first,
    for remove_empty. Where that fails (OSError), it leaves none of them."""
    path = pathlib.Path(os.path.abspath(path))
    missing = [folder for folder in [*reversed(path.parents), path] if not folder.exists()]
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        remove_empty(missing)
        raise
    return missing


def remove_empty(created):
    """Removes the folders a refused run created, given outermost first, where they are still empty: a
    refused run leaves nothing behind."""
    for folder in reversed(created):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def no_links(path, flags):
    """open()'s opener that never follows a symbolic link at path: in a folder others may write to (a shared
    data cache, a team's logs), a link left at a name this run writes would send the write to a file of their
    choosing. With mode "x", not over any file either."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o666)


@contextlib.contextmanager
def temporary_beside(path):
    """A name for a temporary file beside path that nobody can guess (open it with mode "x" and no_links),
    removed if anything fails before it is renamed or linked into place: a full disk, a folder where the file
    should go, a failed rename leave nothing behind."""
    temporary = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        yield temporary
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise


def replace_atomically(path, write, mode="x"):
    """Replaces path in one step with what write(file) writes into a new temporary file beside it (mode "x"
    for text, "xb" for bytes)."""
    with temporary_beside(path) as temporary:
        with open(temporary, mode, opener=no_links) as file:
            write(file)
        os.replace(temporary, path)


def write_atomically(path, text):
    """Replaces path with text in one step."""
    replace_atomically(path, lambda file: file.write(text))


def create_atomically(path, text):
    """Writes text to path, which must not exist: FileExistsError if it does, even when another process
    creates it at the same moment (a hard link never replaces its target), and nothing is left behind."""
    with temporary_beside(path) as temporary:
        with open(temporary, "x", opener=no_links) as file:
            file.write(text)
        os.link(temporary, path)
    os.remove(temporary)


def append_whole(file, text):
    """Appends text to a file opened unbuffered ("ab", buffering=0) in full or not at all: a write that a
    filling disk cuts short is undone before its error goes on, so that a reader never meets half a record."""
    fd, data = file.fileno(), memoryview(text.encode())
    end = os.lseek(fd, 0, os.SEEK_END)
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, end)
        raise


def matplotlib_writes_under(folder):
    """matplotlib keeps a font cache in ~/.cache/matplotlib unless MPLCONFIGDIR names another folder; a run
    writes only under the folders it was given, so its cache goes under folder (a user's MPLCONFIGDIR
    wins). Before matplotlib is imported: it reads the variable once."""
    os.environ.setdefault("MPLCONFIGDIR", os.path.join(os.path.abspath(folder), ".matplotlib"))
