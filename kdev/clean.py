"""kdev clean: what the loop left behind that nothing needs any more, with its size; removed only when asked (--yes).

Kept: every library a build/latest*.json names (the default library and each arch set's latest), every library a
passing ledger record names (deploy-check's evidence, an A/B base that verified), and the newest ledger records.
Removable: other build folders (candidate builds of --kernels, revisions and patches, builds of sources since
changed, their extracted kernels/ trees), temp files and folders of writers that are no longer running (under build/,
vectors/ and .kdev/: a killed build's library and nvcc scratch, a killed gen-refs' half suite), and ledger records past
the newest `keep_records` that are not the newest passing record of their sources and arch. Each byte is counted once:
a temp inside a folder that is listed is not listed again.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from kdev.ledger import read_records
from kdev.fsutil import is_dead_writers_temp, read_json_record


@dataclass
class Item:
    path: Path
    bytes: int
    why: str

    def to_dict(self) -> dict:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def _size(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() or p.is_symlink())


def _kept_libraries(build_dir: Path, records: list[dict]) -> set[Path]:
    kept = set()
    for latest in build_dir.glob("latest*.json"):
        rec = read_json_record(latest, ("library",))
        if rec is not None and isinstance(rec["library"], str):
            kept.add(Path(rec["library"]).resolve())
    for r in records:
        if r.get("passed"):
            for lib in [r.get("library")] + [o.get("library") for o in (r.get("libraries") or {}).values()]:
                if isinstance(lib, str):
                    kept.add(Path(lib).resolve())
    return kept


# the folders whose dead writers' temps clean lists (gen-refs writes its suites under vectors/)
TEMP_ROOTS = ("build", "vectors", ".kdev")


def _inside(path: Path, folders: list[Path]) -> bool:
    return any(f == path or f in path.parents for f in folders)


# what a build/ folder is, by its name's start (the longer prefix first)
_WHY = (("ab-patch-", "a patch applied to kernels/ (made again from the patch on demand)"),
        ("ab-", "a revision's kernels/ (rebuilt from git on demand)"))


def plan(repo: Path, keep_records: int = 1000) -> list[Item]:
    """What `kdev clean --yes` would remove from the checkout at `repo`."""
    build_dir = repo / "build"
    ledger = repo / ".kdev" / "ledger"
    records = read_records(ledger)
    kept_libs = _kept_libraries(build_dir, records)
    items: list[Item] = []
    if build_dir.is_dir():
        for folder in sorted(p for p in build_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
            libs = {p.resolve() for p in folder.rglob("*.so")}
            if libs & kept_libs:
                continue
            why = next((w for prefix, w in _WHY if folder.name.startswith(prefix)),
                       "a build no latest record and no passing verify names")
            items.append(Item(folder, _size(folder), why))
    for root in TEMP_ROOTS:
        for p in sorted((repo / root).rglob(".*")) if (repo / root).is_dir() else []:
            # a temp inside a listed folder (a removable build, a dead temp folder) is counted with that folder
            if is_dead_writers_temp(p) and not _inside(p, [i.path for i in items]):
                items.append(Item(p, _size(p), "a temp of a writer that is no longer running"))
    newest_passing: dict[tuple, str] = {}
    for r in records:
        if r.get("passed"):
            newest_passing[(r.get("source_hash"), r.get("gpu", {}).get("arch"))] = r["_file"]
    keep_files = set(newest_passing.values()) | {r["_file"] for r in records[-keep_records:]}
    for r in records:
        if r["_file"] not in keep_files:
            f = Path(r["_file"])
            items.append(Item(f, f.stat().st_size, "a ledger record older than the newest "
                                                    f"{keep_records} and not the newest pass of its sources"))
    return items


def remove(items: list[Item]) -> None:
    for it in items:
        if it.path.is_dir() and not it.path.is_symlink():
            shutil.rmtree(it.path, ignore_errors=True)
        else:
            it.path.unlink(missing_ok=True)


def summary(items: list[Item]) -> dict:
    return {"items": [i.to_dict() for i in items], "bytes": sum(i.bytes for i in items)}
