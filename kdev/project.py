"""Which kdev checkout a command works on: the one rule every command follows.

The project root is the nearest folder, from the current directory upward, that holds a kdev checkout's markers
(kernels/include/kdev/kdtree.h and configs/build.yaml); $KDEV_REPO names one explicitly. So a command run in
kernels/ works on the checkout around it, and a second clone sharing one virtual environment builds and checks
itself, not the clone kdev was installed from. Outside any checkout, a command that needs one says so in one line
(`require_root`); the package's own checkout still supplies the defaults that `--help` shows.
"""

from __future__ import annotations

import os
from pathlib import Path

MARKERS = (Path("kernels") / "include" / "kdev" / "kdtree.h", Path("configs") / "build.yaml")
PACKAGE_CHECKOUT = Path(__file__).resolve().parent.parent


def is_checkout(path: Path) -> bool:
    return all((path / m).is_file() for m in MARKERS)


def find_root(start: Path | None = None) -> Path | None:
    """The nearest kdev checkout at or above `start` (default: the current directory), or None."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if is_checkout(folder):
            return folder
    return None


def _root() -> Path | None:
    named = os.environ.get("KDEV_REPO")
    if named:
        path = Path(named).resolve()
        return path if is_checkout(path) else None
    try:
        return find_root()
    except OSError:  # the current directory was removed under us
        return None


ROOT = _root()  # None: not inside a kdev checkout
REPO_ROOT = ROOT or PACKAGE_CHECKOUT


def require_root() -> Path:
    """The project root, or BadInput in one line where there is none."""
    if ROOT is None:
        from kdev.errors import BadInput

        named = os.environ.get("KDEV_REPO")
        if named:
            raise BadInput(f"KDEV_REPO={named}: not a kdev checkout (no {MARKERS[0]} and {MARKERS[1]} there)")
        raise BadInput(f"{Path.cwd()}: not inside a kdev checkout (no {MARKERS[0]} and {MARKERS[1]} here or above): "
                       "cd into one, or set KDEV_REPO")
    return ROOT
