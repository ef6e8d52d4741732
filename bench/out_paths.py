"""Output paths of the bench commands, checked writable before anything is measured: a run of many
minutes must not end in "No such file or directory" with its results lost."""
from __future__ import annotations

import tempfile
from pathlib import Path


def writable_dir(path: str | Path) -> Path:
    """Create the folder `path` (and its parents) where missing and check a file can be written in it.

    Raises:
        OSError: the folder cannot be created or written to (the message names it).
    """
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as err:
        raise OSError(f"cannot write to the output folder {folder}: {err.strerror or err}") from None
    return folder


def writable_file(path: str | Path) -> Path:
    """Create the parent folder of the file `path` where missing and check the file can be written
    there (an existing file is left untouched).

    Raises:
        OSError: the path is a folder, or the file or its folder cannot be written (the message names it).
    """
    file = Path(path)
    if file.is_dir():
        raise OSError(f"the output file {file} is a folder")
    writable_dir(file.parent)
    if file.exists():
        try:
            with open(file, "a"):
                pass
        except OSError as err:
            raise OSError(f"cannot write the output file {file}: {err.strerror or err}") from None
    return file
