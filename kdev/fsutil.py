"""Atomic file writes: a temp file in the same folder, fsync, then rename. Nothing is ever half-written. And the
reading of kdev's own JSON records (build/latest.json, build.json, cached ceilings), where one that is missing or
damaged stands for no record."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:  # said of the file asked for, not of the temp file's made-up name
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json_record(path: Path, keys: tuple = ()) -> dict | None:
    """A JSON object kdev wrote, or None where the file is missing, unreadable, not JSON, not an object, or lacks
    one of `keys`: the caller then does what it does without a record (rebuilds, measures, says to run kdev build)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and all(k in doc for k in keys) else None

