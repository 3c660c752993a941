"""Files that are whole or absent: written under a temporary name in the same folder, then renamed into
place, so that a reader never sees half a file and a crash leaves no torn one."""

import os


def write_atomically(path, text):
    """Replaces path with text in one step."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as file:
        file.write(text)
    os.replace(temporary, path)


def create_atomically(path, text):
    """Writes text to path, which must not exist: FileExistsError if it does, even when another process
    creates it at the same moment (a hard link never replaces its target), and nothing is left behind."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as file:
        file.write(text)
    try:
        os.link(temporary, path)
    finally:
        os.remove(temporary)
