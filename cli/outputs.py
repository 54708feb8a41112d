"""How evaluation commands write results: one overwrite rule, atomic writes, readable files.

Every command that writes a result refuses an existing one unless ``--overwrite``, before any
model loads. Files are written to a temporary name and renamed, so a crash never leaves half a
result; ``tempfile.mkstemp`` creates that name with mode 0600, so the final file is given the
mode ``open()`` would have given it (0644 under umask 022): colleagues on a shared cluster can
read results and exported weights.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def output_refusal(path: Path, overwrite: bool) -> str | None:
    """Why ``--output path`` cannot be written (a folder, or existing without ``overwrite``)."""
    if path.is_dir():
        return f"--output {path} is a folder; give a file path"
    if path.exists() and not overwrite:
        return f"--output {path} exists: pass --overwrite to replace it"
    return None


def umask_mode() -> int:
    """The mode a new file gets from ``open()``: 0o666 less the process umask."""
    umask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(umask)
    return 0o666 & ~umask


def make_readable(path: Path) -> None:
    """Give ``path`` (written by a library that used a private temporary file) the umask's mode."""
    os.chmod(path, umask_mode())


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it, with the umask's mode."""
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.chmod(tmp, umask_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
