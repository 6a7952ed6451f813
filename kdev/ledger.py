"""The verification ledger: one JSON file per kdev verify run under .kdev/ledger/ ($KDEV_LEDGER), named by its time
and a random suffix and written atomically, so concurrent runs never clobber each other. deploy-check reads the newest
records; kdev clean prunes the old ones.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import uuid
from pathlib import Path

from kdev.config import WORK_ROOT
from kdev.fsutil import atomic_write_bytes

LEDGER_SCHEMA = 1


def ledger_dir() -> Path:
    return Path(os.environ.get("KDEV_LEDGER", WORK_ROOT / ".kdev" / "ledger"))


def append_record(record: dict, folder: Path | None = None) -> Path:
    """One file per record, unique name, atomic rename: concurrent runs never clobber each other."""
    folder = Path(folder) if folder else ledger_dir()
    folder.mkdir(parents=True, exist_ok=True)
    stamp = record["timestamp"].replace(":", "").replace("-", "")
    path = folder / f"{stamp}-{uuid.uuid4().hex[:12]}.json"
    atomic_write_bytes(path, json.dumps(record, indent=1, allow_nan=False, default=str).encode())
    return path


def read_records(folder: Path | None = None, newest: int | None = None) -> list[dict]:
    """The readable ledger records, oldest first, all of them or the `newest` N (file names start with the record's
    time, so the newest are the last by name and the rest is never opened); unreadable files are skipped, never
    fatal."""
    folder = Path(folder) if folder else ledger_dir()
    recs = []
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    for f in files[-newest:] if newest else files:
        try:
            r = json.loads(f.read_text())
            r["_file"] = str(f)
            recs.append(r)
        except (OSError, ValueError):
            continue
    return recs


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
