"""Which kdev checkout a command works on: the one rule every command follows.

The project root is the nearest folder, from the current directory upward, that holds a kdev checkout's markers
(kernels/include/kdev/kdtree.h and configs/build.yaml); $KDEV_REPO names one explicitly. So a command run in
kernels/ works on the checkout around it, and a second clone sharing one virtual environment builds and checks
itself, not the clone kdev was installed from. Outside any checkout, a command that needs one says so in one line
(`require_root`); the package's own checkout still supplies the defaults that `--help` shows.

An installed kdev (a wheel, no checkout near) reads what it ships: the kernel sources and their header, configs/,
the smoke golden vectors and benchmarks/ lie in the package as `kdev/_project` (setup.py copies them there when the
wheel is built). What it makes (builds keyed by source hash and archs, the ledger, the measured ceilings, suites it
generates) goes to a folder of the user's: $KDEV_HOME, else $XDG_CACHE_HOME/kdev (~/.cache/kdev). In a checkout
both are the checkout itself.
"""

from __future__ import annotations

import os
from pathlib import Path

MARKERS = (Path("kernels") / "include" / "kdev" / "kdtree.h", Path("configs") / "build.yaml")
SHIPPED = Path(__file__).resolve().parent / "_project"  # an installed wheel's kernels, configs, vectors, benchmarks


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


def _package_checkout() -> Path:
    """The checkout the package was installed from (an editable install), else the tree a wheel ships."""
    source = Path(__file__).resolve().parent.parent
    return source if is_checkout(source) else SHIPPED


def _work_root(root: Path | None, package: Path) -> Path:
    if root is not None:
        return root
    if os.environ.get("KDEV_HOME"):
        return Path(os.environ["KDEV_HOME"]).resolve()
    if package != SHIPPED:
        return package  # an editable install used from outside its checkout: its checkout, as always
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kdev"


ROOT = _root()  # None: not inside a kdev checkout
PACKAGE_CHECKOUT = _package_checkout()
REPO_ROOT = ROOT or PACKAGE_CHECKOUT  # where kdev reads its kernels, configs, golden vectors and benchmarks
WORK_ROOT = _work_root(ROOT, PACKAGE_CHECKOUT)  # where it writes its builds, ledger, ceilings and generated suites
INSTALLED = ROOT is None and PACKAGE_CHECKOUT == SHIPPED  # a wheel's kdev, no checkout in use


def require_root() -> Path:
    """The project root, or BadInput in one line where there is none (an installed kdev's root is the tree it ships;
    what it writes goes to WORK_ROOT)."""
    if ROOT is None and INSTALLED and not os.environ.get("KDEV_REPO"):
        return REPO_ROOT
    if ROOT is None:
        from kdev.errors import BadInput

        named = os.environ.get("KDEV_REPO")
        if named:
            raise BadInput(f"KDEV_REPO={named}: not a kdev checkout (no {MARKERS[0]} and {MARKERS[1]} there)")
        raise BadInput(f"{Path.cwd()}: not inside a kdev checkout (no {MARKERS[0]} and {MARKERS[1]} here or above): "
                       "cd into one, or set KDEV_REPO")
    return ROOT
