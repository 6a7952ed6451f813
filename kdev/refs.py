"""Another build, named by a reference: a library or its build folder, a copy of kernels/, a git revision whose
kernels/ to extract, or a patch of this checkout's kernels/ (as variants/ holds). kdev ab, kdev sass --against,
KERNEL@REF in verify and bench and `kdev build --kernels` find their other build here; trees are written once under
build/ and built as A/B variants (latest.json left alone).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from kdev import build as kbuild
from kdev.build import KERNEL_DIR, LIB_NAME, BuildResult, library_file, source_hash
from kdev.config import REPO_ROOT
from kdev.errors import BadInput
from kdev.fsutil import make_temp_dir, raise_if_stopped, signals_deferred


def git_revision(ref: str, repo: Path = REPO_ROOT) -> str | None:
    """The full commit id `ref` names in repo (a branch, a tag, a sha, HEAD~1), or None."""
    try:
        r = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def is_kernel_tree(path: Path) -> bool:
    """A copy of kernels/ (an A/B base or candidate): its include/ folder and at least one .cu file."""
    return path.is_dir() and (path / "include").is_dir() and any(path.glob("*.cu"))


PATCH_SUFFIXES = (".patch", ".diff")
NO_LIBRARY_REF = "no library, build folder, copy of kernels/, git revision or kernels patch"


def describe_library_ref(ref: str, repo: Path = REPO_ROOT) -> str | None:
    """What `ref` names for a library to load: "library" (a .so or a build folder), "kernels" (a copy of
    kernels/ to build), "revision" (a git revision whose kernels/ to build), "patch" (a .patch or .diff file, as
    variants/ holds: this checkout's kernels/ with it applied, to build), or None."""
    p = Path(ref)
    if p.is_file() and p.suffix in PATCH_SUFFIXES:
        return "patch"
    if p.is_file() or (p.is_dir() and (p / LIB_NAME).is_file()):
        return "library"
    if is_kernel_tree(p):
        return "kernels"
    return "revision" if git_revision(ref, repo) else None


def revision_kernels(ref: str, repo: Path = REPO_ROOT, output_dir: Path | None = None) -> Path:
    """kernels/ as commit `ref` has it, extracted once into build/ab-<commit>/kernels (named by the commit, so a
    second call finds it; written into a temporary folder first and renamed, so a half-written tree is never
    found)."""
    import io
    import tarfile

    sha = git_revision(ref, repo)
    if sha is None:
        raise BadInput(f"{ref}: no such git revision in {repo}")
    dest = (output_dir or repo / "build") / f"ab-{sha[:12]}"
    if is_kernel_tree(dest / "kernels"):
        return dest / "kernels"
    r = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", sha, "kernels"], capture_output=True)
    if r.returncode != 0:
        raise BadInput(f"{ref}: git archive of its kernels/ failed: "
                       f"{(r.stderr.decode(errors='replace').strip().splitlines() or ['?'])[-1]}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        with signals_deferred():  # a kill now lands inside this try, where the temp folder is removed
            tmp = make_temp_dir(dest.parent, f"ab-{sha[:12]}")
        with tarfile.open(fileobj=io.BytesIO(r.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        _swap_in(tmp, dest)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest / "kernels"


def patch_kernels(patch: Path, kernel_dir: Path = KERNEL_DIR, output_dir: Path | None = None) -> Path:
    """kernel_dir (this checkout's kernels/) with `patch` applied by git apply (paths kernels/..., as the files in
    variants/ have them), written once into build/ab-patch-<hash>/kernels: the hash covers the patch and the kernel
    sources it was applied to, so an edit to either makes a new tree and a second call finds this one. Written into a
    temporary folder first and renamed, so a half-written tree is never found; a patch that does not apply is bad
    input, with git's first line."""
    patch = Path(patch).resolve()
    digest = hashlib.sha256(patch.read_bytes() + source_hash(kernel_dir).encode()).hexdigest()[:12]
    dest = (output_dir or REPO_ROOT / "build") / f"ab-patch-{digest}"
    if is_kernel_tree(dest / "kernels"):
        return dest / "kernels"
    tmp = None
    try:
        with signals_deferred():  # a kill now lands inside this try, where the temp folder is removed
            tmp = make_temp_dir(dest.parent, f"ab-patch-{digest}")
        shutil.copytree(kernel_dir, tmp / "kernels")
        # inside a repository git apply would patch that repository's paths: the ceiling keeps it to tmp
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp.parent)}
        r = subprocess.run(["git", "apply", str(patch)], cwd=tmp, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise BadInput(f"{patch.name}: does not apply to {kernel_dir}: "
                           f"{(r.stderr.strip().splitlines() or ['?'])[0]}")
        _swap_in(tmp, dest)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest / "kernels"


def _swap_in(tmp: Path, dest: Path) -> None:
    """The finished tree `tmp` put in place of `dest` (whatever is there is not a kernel tree), unless a stop was
    taken."""
    raise_if_stopped()
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)


def library_for(ref: str, archs: list[str], log=None, repo: Path = REPO_ROOT) -> BuildResult | Path:
    """The library `ref` names: a library file or build folder as it is (its path); a copy of kernels/, a git
    revision's kernels/ (extracted by revision_kernels) or this checkout's kernels/ with a patch applied
    (patch_kernels), built for `archs` into a library of its own as an A/B variant (kdev build --kernels: cached by
    content, latest.json left alone; its BuildResult)."""
    from kdev import config

    kind = describe_library_ref(ref, repo)
    if kind is None:
        raise BadInput(f"{ref}: {NO_LIBRARY_REF}")
    if kind == "library":
        return library_file(Path(ref))
    tree = {"kernels": lambda: Path(ref).resolve(), "revision": lambda: revision_kernels(ref, repo),
            "patch": lambda: patch_kernels(Path(ref), repo / "kernels")}[kind]()
    return kbuild.build(config.load_build(None, list(archs)), log=log, kernel_dir=tree, variant=True)
