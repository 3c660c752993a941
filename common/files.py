"""How the project writes files: whole or not at all (under a temporary name in the same folder, then renamed
into place, so that a reader never sees half a file and a crash leaves no torn one), and only under the
folders a user named, libraries' caches included."""

import contextlib
import os


@contextlib.contextmanager
def temporary_beside(path):
    """The name of a temporary file beside path, removed if anything fails before it is renamed or linked
    into place: a full disk, a folder where the file should go, a failed rename leave nothing behind."""
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        yield temporary
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise


def write_atomically(path, text):
    """Replaces path with text in one step."""
    with temporary_beside(path) as temporary:
        with open(temporary, "w") as file:
            file.write(text)
        os.replace(temporary, path)


def create_atomically(path, text):
    """Writes text to path, which must not exist: FileExistsError if it does, even when another process
    creates it at the same moment (a hard link never replaces its target), and nothing is left behind."""
    with temporary_beside(path) as temporary:
        with open(temporary, "w") as file:
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
