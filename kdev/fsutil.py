"""Atomic file writes: a temp file in the same folder, fsync, then rename. Nothing is ever half-written, and what is
written gets the modes a plain write would give it (the umask's), so another account (an inference server's) can read
the vectors and load the library. Temp files and folders carry their writer's PID, so a later run removes those of a
writer that was killed; a stop signal (Ctrl-C, SIGTERM, SIGHUP) is held back while a temp is made or swapped in, and
once taken it stops the program at the next write even where library code swallowed it. And the reading of kdev's own
JSON records (build/latest.json, build.json, cached ceilings), where one that is missing or damaged stands for no
record."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from kdev.errors import Terminated

DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_stops_taken: list[int] = []  # the stop signals stop_on_signal took, first first


def stop_on_signal(signum: int, frame) -> None:
    """The CLI's handler of SIGINT, SIGTERM and SIGHUP: raises KeyboardInterrupt or Terminated where the program is, so
    that every `finally` runs, and records the signal. Recorded because library code may swallow the exception:
    Cython's module initialisation clears any error raised while it registers its types with collections.abc, and a
    SIGTERM that landed there (numpy.random's first import, at the start of gen-refs) was lost, and the run wrote its
    suite and exited 0. raise_if_stopped raises it again before anything is written."""
    _stops_taken.append(signum)
    raise_if_stopped()


def raise_if_stopped() -> None:
    """Raise the first stop signal taken (KeyboardInterrupt for SIGINT, else Terminated) if one was."""
    if _stops_taken:
        if _stops_taken[0] == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(_stops_taken[0])


@contextlib.contextmanager
def signals_deferred():
    """SIGINT and SIGTERM held back while the block runs and acted on as it ends: a temp that is made and not yet inside
    the try that removes it, or a rename swap half done, is never left by Ctrl-C or a kill. Python runs signal handlers
    in the main thread whichever thread the signal reached, so the block's own handlers only note the signal; the
    handlers of before take it at the end (their exception raised at the block's end, inside the caller's try)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers can be set in the main thread only, and run only there
        return
    raise_if_stopped()  # a stop that was taken and swallowed: nothing more is written
    pending: list[int] = []
    before = {s: signal.getsignal(s) for s in DEFERRED_SIGNALS}
    for s in DEFERRED_SIGNALS:
        signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        for signum in pending[:1]:
            handler = before[signum]
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


def umask() -> int:
    """This process's umask (read without changing it where /proc says it)."""
    try:
        m = re.search(r"^Umask:\s*([0-7]+)", Path("/proc/self/status").read_text(), flags=re.M)
        if m:
            return int(m.group(1), 8)
    except OSError:
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def normal_mode(executable: bool = False) -> int:
    """The mode open() or mkdir() would give a new file (0o666) or folder / program (0o777) under the umask."""
    return (0o777 if executable else 0o666) & ~umask()


def temp_name(stem: str) -> str:
    """The prefix of a temp file or folder for `stem`, naming this process: `.{stem}.{pid}.`."""
    return f".{stem}.{os.getpid()}."


def make_temp_dir(parent: Path, stem: str, suffix: str = ".tmp") -> Path:
    """A new folder in `parent` (created if missing) for a tree to be renamed into place, with a plain mkdir's mode."""
    parent = Path(parent)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=temp_name(stem), suffix=suffix, dir=parent))
    except OSError as e:  # said of the folder asked for, not of the temp folder's made-up name
        raise OSError(e.errno, e.strerror, str(parent)) from None
    os.chmod(tmp, normal_mode(executable=True))
    return tmp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def is_dead_writers_temp(path: Path) -> bool:
    """A temp file or folder (temp_name(stem) + mkstemp's letters) whose writer, the PID in its name, is gone."""
    m = re.match(r"^\.[^/]+?\.(\d+)\.[^.]*\.(tmp|old|so)$", Path(path).name)
    return m is not None and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1)))


def remove_dead_writers_temps(parent: Path) -> list[Path]:
    """Remove the temp files and folders in `parent` whose writer (the PID in their name) is no longer running: what a
    SIGKILL, or a power cut, left. Returns what was removed."""
    removed = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    for p in entries:
        if not is_dead_writers_temp(p):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    tmp = None
    try:
        with signals_deferred():  # a kill now lands inside this try, where the temp is removed
            try:
                fd, tmp = tempfile.mkstemp(prefix=temp_name(path.name), suffix=".tmp", dir=path.parent)
            except OSError as e:  # said of the file asked for, not of the temp file's made-up name
                raise OSError(e.errno, e.strerror, str(path)) from None
        os.fchmod(fd, normal_mode())  # mkstemp's 0600 would keep every other account out
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
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

