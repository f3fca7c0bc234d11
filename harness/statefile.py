"""Files the harness writes and reads back to decide what to do next (a run's `run.json`, a built
world's `world.json`, the reference summary): written so that a kill, a crash or a full disk leaves
the old file or the new one, never a part of one, and read with an error that names the file.

Writing: the text goes to a temporary file beside the target, is flushed to the disk (fsync) and
then renamed over the target (`os.replace`, atomic on POSIX and Windows); the folder is synced too,
so the rename itself survives a power cut. A failed write (ENOSPC) removes the temporary file and
raises, the old file untouched."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any


class StateFileError(ValueError):
    """A state file that exists but cannot be read as what it should hold; the message names it."""


def write_atomic(path: str | Path, text: str | bytes) -> None:
    """Replace `path` with `text` (str: as UTF-8; bytes: as they are) all at once: readers see the old
    content or the new."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    data = text.encode("utf-8") if isinstance(text, str) else text
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # a folder cannot be opened for syncing on every OS (Windows)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_json(path: str | Path, obj: Any, **dump: Any) -> None:
    """`obj` as JSON (json.dumps keyword arguments in `dump`), written atomically, ending in a newline."""
    write_atomic(path, json.dumps(obj, **dump) + "\n")


def read_json_object(path: str | Path) -> dict[str, Any]:
    """The JSON object in `path`; StateFileError naming the file when it is unreadable, not UTF-8,
    truncated or not an object (FileNotFoundError when it does not exist)."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        size = path.stat().st_size if path.exists() else 0
        raise StateFileError(f"{path} is unreadable ({size} bytes; {type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise StateFileError(f"{path} is unreadable (a JSON object expected, got {type(obj).__name__})")
    return obj
