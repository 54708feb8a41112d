"""How commands write results: one output guard, atomic writes, readable files.

Every command that writes calls :func:`guard_outputs` (files) or :func:`guard_writable`
(folders) before any model loads: an existing result is refused unless ``--overwrite``, and a
destination this process cannot write is refused in one line, not a ``PermissionError`` after
the work. Files are written to a temporary name and renamed, so a crash never leaves half a
result; ``tempfile.mkstemp`` creates that name with mode 0600, so the final file is given the
mode ``open()`` would have given it (0644 under umask 022): colleagues on a shared cluster can
read results and exported weights.

This module imports nothing of sinklm at import time (``UserError`` is imported when a refusal
is raised), so every package, training and export included, may use the guard.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn


def _refuse(message: str) -> NoReturn:
    from sinklm.cli.main import UserError

    raise UserError(message)


def unwritable(path: Path) -> str | None:
    """Why ``path`` cannot be written, or None: a missing path is created in its nearest
    existing folder, an existing file is replaced in its folder, an existing folder is written
    into; each of those folders must let this process create entries (write and search)."""
    path = Path(os.path.abspath(path.expanduser()))
    if path.is_file() and not os.access(path, os.W_OK):
        return f"{path} is read-only"
    folder = path if path.is_dir() else next(p for p in path.parents if p.exists())
    if not path.exists() and not folder.is_dir():
        return f"{folder} is a file, so {path} cannot be created"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"no permission to write in {folder}"
    return None


def guard_writable(paths: Sequence[Path], flag: str = "--output") -> None:
    """Refuse, naming ``flag`` and its value ``paths[0]``, the first of ``paths`` that cannot
    be written (see :func:`unwritable`)."""
    for path in paths:
        reason = unwritable(path)
        if reason is not None:
            _refuse(f"{flag} {paths[0]} cannot be written: {reason}; choose another {flag} or "
                    "fix the permissions")


def guard_outputs(paths: Sequence[Path], overwrite: bool, flag: str = "--output") -> None:
    """Refuse before any work the files a command will write: ``paths[0]`` is the value of
    ``flag``, the others the files it writes beside it. A folder in the way, an existing file
    without ``overwrite`` (a result of other inputs: it is never replaced silently) and a file
    that cannot be written are each refused in one line naming the file."""
    first = paths[0]
    for path in paths:
        where = f"{flag} {path}" if path == first else f"{path} (written beside {flag} {first})"
        if path.is_dir():
            _refuse(f"{where} is a folder; give a file path" if path == first
                    else f"{where} is a folder; move it or choose another {flag}")
        if path.exists() and not overwrite:
            _refuse(f"{where} exists: pass --overwrite to replace it")
    guard_writable(paths, flag)


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
