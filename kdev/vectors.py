"""Golden vector suites: write (safetensors + manifest), load, integrity check; the cases themselves come from
kdev/cases.py.

A suite lives in one folder: one safetensors file per case and manifest.yaml (schema version, hash of the
generator sources, seeds, case specs, shapes, dtypes, tolerances, sha256 per file). A case holds
  inputs  q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask   (the kernel contract, docs/architecture.md §2)
          kv_scale ([1] float32, e4m3 cases only: kv_cache is float8_e4m3fn, a value is the stored one times it)
  tree    tree_tokens, tree_parents, tree_depths, tree_positions     ([N_q], in q_indptr order)
          drafter_log_probs, drafter_token_ids                       ([B, D, K], DDTree cases only)
  golden  out (float32), lse (float64), computed in float64 from the bf16-rounded inputs
  accept  accept_target ([N_q], the target's argmax per node), accept_nodes ([B, T_max], -1 padded),
          accept_len, bonus_token ([B]), compact_rows ([Σ accept_len, 576] bf16: the rows in slots
          prefix_len.. after KV compaction)
tree_mask holds the uint64 words as int64 (same bits): safetensors readers handle int64 everywhere.
The golden out is stored in float32 (its storage rounding, 2^-24 relative, is five orders of magnitude
under the bf16 tolerances) so that the committed smoke suite stays small; --check allows exactly that
rounding on out and 1e-12 relative on lse.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kdev.cases import CaseData, cache_bits, generate_case
from kdev.config import SuiteSpec, Tolerances, load_model, load_yaml
from kdev.errors import BadInput
from kdev.fsutil import atomic_write_bytes, make_temp_dir, remove_dead_writers_temps, signals_deferred

SCHEMA_VERSION = 1
MANIFEST = "manifest.yaml"
INPUT_KEYS = ("q", "kv_cache", "page_table", "prefix_lens", "q_indptr", "tree_mask")
TREE_KEYS = ("tree_tokens", "tree_parents", "tree_depths", "tree_positions")
GOLDEN_KEYS = ("out", "lse")
ACCEPT_KEYS = ("accept_target", "accept_nodes", "accept_len", "bonus_token", "compact_rows")
_GENERATOR_SOURCES = ("mla.py", "ddtree.py", "cases.py", "vectors.py")


def generator_hash() -> str:
    """sha256 over the reference sources that determine a suite's contents."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in _GENERATOR_SOURCES:
        h.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------------------ writing
def case_bytes(case: CaseData) -> bytes:
    # One metadata key: the header's metadata map has no fixed order, and files must be byte-identical.
    meta = {"kdev": json.dumps({"case": case.spec.name, "schema_version": SCHEMA_VERSION}, sort_keys=True)}
    return st_save({k: v.contiguous() for k, v in case.tensors.items()}, metadata=meta)


def manifest_entry(case: CaseData, data: bytes) -> dict:
    return {
        "name": case.spec.name,
        "file": f"{case.spec.name}.safetensors",
        "sha256": sha256_bytes(data),
        "bytes": len(data),
        "seed": case.spec.seed,
        "spec": case.spec.to_dict(),
        "scale": case.scale,
        "tree_sizes": case.trees_T,
        "shapes": {k: list(v.shape) for k, v in case.tensors.items()},
        "dtypes": {k: str(v.dtype).replace("torch.", "") for k, v in case.tensors.items()},
        "tolerances": case.spec.tolerances.to_dict(),
    }


def write_suite(suite: SuiteSpec, out_root: Path, force: bool = False, device: str = "cpu",
                progress=None) -> dict:
    """Generate every case into a temp folder beside the target, then swap it in with a rename, so an
    interrupted run leaves no half suite that looks valid. Refuses to replace an existing suite unless force."""
    out_root = Path(out_root)
    target = out_root / suite.name
    if target.exists() and not force:
        raise BadInput(f"{target}: suite already exists (use --force to overwrite)")
    remove_dead_writers_temps(out_root)
    tmp = None
    try:
        with signals_deferred():  # a kill now lands inside this try, where the temp folder is removed
            tmp = make_temp_dir(out_root, suite.name)
        entries = []
        kept = _stored_cases(target) if target.exists() else {}
        for spec in suite.cases:
            case = generate_case(spec, device)
            data = case_bytes(case)
            old_data = kept.get(f"{spec.name}.safetensors")
            if old_data is not None and data != old_data and not _differs(old_data, case):
                data = old_data  # the same case, its goldens within the bound: the committed bytes stay
            atomic_write_bytes(tmp / f"{spec.name}.safetensors", data)
            entries.append(manifest_entry(case, data))
            if progress:
                progress(spec.name)
        manifest = {"schema_version": SCHEMA_VERSION, "suite": suite.name, "description": suite.description,
                    "generator_hash": generator_hash(), "cases": entries}
        atomic_write_bytes(tmp / MANIFEST, yaml.safe_dump(manifest, sort_keys=False).encode())
        old = None
        with signals_deferred():  # the swap is never left half done: the suite it replaces is not lost
            if target.exists():
                old = make_temp_dir(out_root, suite.name, ".old")
                os.replace(target, old / suite.name)
            os.replace(tmp, target)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _stored_cases(folder: Path) -> dict[str, bytes]:
    """The case files of an existing suite folder by name (unreadable ones left out: they are regenerated)."""
    out = {}
    for f in folder.glob("*.safetensors"):
        try:
            out[f.name] = f.read_bytes()
        except OSError:
            pass
    return out


def _differs(data: bytes, case: CaseData) -> bool:
    try:
        stored = st_load(data)
    except (SafetensorError, ValueError):
        return True
    return bool(case_differences(stored, case))


def read_manifest(path: Path) -> dict:
    """A suite's manifest.yaml; malformed YAML or another schema is BadInput, one line naming the file."""
    manifest = load_yaml(path)
    if not isinstance(manifest, dict) or manifest.get("schema_version") != SCHEMA_VERSION or \
            not isinstance(manifest.get("cases"), list):
        raise BadInput(f"{path}: not a schema-{SCHEMA_VERSION} kdev manifest")
    return manifest


def append_case(out_root: Path, suite_name: str, case: CaseData, description: str = "") -> Path:
    """Add one case to a suite folder (created when missing): its file first, then the manifest, each
    written atomically. Used to keep failing fuzz cases as regression vectors."""
    folder = Path(out_root) / suite_name
    folder.mkdir(parents=True, exist_ok=True)
    mpath = folder / MANIFEST  # read first: a damaged manifest is refused before anything is written
    manifest = read_manifest(mpath) if mpath.is_file() else {
        "schema_version": SCHEMA_VERSION, "suite": suite_name, "description": description,
        "generator_hash": generator_hash(), "cases": []}
    data = case_bytes(case)
    atomic_write_bytes(folder / f"{case.spec.name}.safetensors", data)
    manifest["cases"] = [c for c in manifest["cases"] if c["name"] != case.spec.name] + [manifest_entry(case, data)]
    atomic_write_bytes(mpath, yaml.safe_dump(manifest, sort_keys=False).encode())
    return folder / f"{case.spec.name}.safetensors"


# ------------------------------------------------------------------------------------------ loading
@dataclass
class Suite:
    path: Path
    manifest: dict

    @property
    def name(self) -> str:
        return self.manifest["suite"]

    @property
    def cases(self) -> list[dict]:
        return self.manifest["cases"]

    @property
    def manifest_sha256(self) -> str:
        return sha256_bytes((self.path / MANIFEST).read_bytes())

    @property
    def stale(self) -> bool:
        return self.manifest.get("generator_hash") != generator_hash()

    def load_case(self, entry: dict) -> dict:
        """Tensors of one case, after its sha256 is checked against the manifest."""
        f = self.path / entry["file"]
        if not f.is_file():
            raise BadInput(f"{f}: vector file missing")
        data = f.read_bytes()
        if sha256_bytes(data) != entry["sha256"]:
            raise BadInput(f"{f}: sha256 does not match the manifest (tampered or truncated)")
        try:
            tensors = st_load(data)
        except SafetensorError as e:
            raise BadInput(f"{f}: unreadable safetensors file: {e}") from None
        missing = [k for k in INPUT_KEYS + TREE_KEYS + GOLDEN_KEYS + ACCEPT_KEYS if k not in tensors]
        if missing:
            raise BadInput(f"{f}: missing tensors {', '.join(missing)}")
        return tensors

    def tolerances(self, entry: dict) -> Tolerances:
        return Tolerances.from_dict(entry["tolerances"])

    def check_integrity(self) -> None:
        for entry in self.cases:
            self.load_case(entry)

    def config_drift(self, spec: SuiteSpec) -> list[str]:
        """Where the manifest no longer says what the suite config says: the case set, each case's spec,
        tolerances and softmax scale. The sha256 values protect the vector files, not the manifest itself,
        so this is what catches a tolerance loosened by hand. One line per problem."""
        problems = []
        on_disk = {e["name"]: e for e in self.cases}
        for name in sorted(set(on_disk) - {c.name for c in spec.cases}):
            problems.append(f"{on_disk[name]['file']}: on disk but not in the suite config")
        for cs in spec.cases:
            e = on_disk.get(cs.name)
            if e is None:
                problems.append(f"{cs.name}.safetensors: in the suite config but not on disk")
                continue
            for what, stored, want in (("spec", e.get("spec"), cs.to_dict()),
                                       ("tolerances", e.get("tolerances"), cs.tolerances.to_dict()),
                                       ("scale", e.get("scale"), load_model(cs.model).softmax_scale)):
                if stored != want:
                    problems.append(f"{e['file']}: manifest {what} {stored!r} differs from the config's {want!r}")
        return problems


def resolve_suite_path(name_or_path: str, root: Path | None = None) -> Path:
    p = Path(name_or_path)
    if (p / MANIFEST).is_file():
        return p
    roots = [Path(root)] if root else list(dict.fromkeys([default_vectors_root(), shipped_vectors_root()]))
    for r in roots:
        if (r / name_or_path / MANIFEST).is_file():
            return r / name_or_path
    places = " or ".join(map(str, dict.fromkeys([p, *(r / name_or_path for r in roots)])))  # one place for an absolute path
    raise BadInput(f"{name_or_path}: no suite there (no {MANIFEST} in {places}); "
                   f"generate it with 'kdev gen-refs --suite {p.name}'")


def default_vectors_root() -> Path:
    """Where suites are generated: the checkout's vectors/, or an installed kdev's own folder (kdev/project.py)."""
    from kdev.config import WORK_ROOT

    return WORK_ROOT / "vectors"


def shipped_vectors_root() -> Path:
    """Where the committed suites are read when a suite is not among the generated ones: the checkout's vectors/, or
    the ones an installed kdev ships."""
    from kdev.config import REPO_ROOT

    return REPO_ROOT / "vectors"


def open_suite(name_or_path: str, root: Path | None = None, allow_stale: bool = False, warn=None) -> Suite:
    path = resolve_suite_path(name_or_path, root)
    manifest = read_manifest(path / MANIFEST)
    suite = Suite(path, manifest)
    if suite.stale:
        msg = (f"{path}: stale vectors: generated by reference sources {manifest.get('generator_hash', '?')[:12]}, "
               f"current are {generator_hash()[:12]}")
        if not allow_stale:
            raise BadInput(msg + " (regenerate with 'kdev gen-refs --force', or pass --allow-stale)")
        if warn:
            warn(msg)
    return suite


# ------------------------------------------------------------------------------------------ --check
# Reference outputs are float64 sums whose last bit depends on the CPU's vector width (numpy's pairwise sums): the same
# inputs give lse values 1 ulp apart on two machines. They are compared within this bound of the largest magnitude.
GOLDEN_REL_TOL = 1e-12


def case_differences(stored: dict, case: CaseData, rel_tol: float = GOLDEN_REL_TOL) -> list[str]:
    """What differs between a case's stored tensors and a fresh generation of it: inputs (and every other
    non-golden tensor) must be bit-identical, golden outputs within rel_tol of the largest magnitude (plus, for the
    float32-stored out, its storage rounding per element). An empty list: the stored case is this case."""
    bad = []
    for k, v in case.tensors.items():
        s = stored.get(k)
        if s is None or s.shape != v.shape or s.dtype != v.dtype:
            bad.append(f"{k} (shape/dtype)")
        elif k in GOLDEN_KEYS:
            fresh64 = case.golden64[k]
            ref = fresh64.abs().max().item() or 1.0
            storage = 2.0**-24 * fresh64.abs() if s.dtype == torch.float32 else 0.0
            excess = ((s.double() - fresh64).abs() - storage).max().item()
            if not excess <= rel_tol * ref:
                bad.append(f"{k} (relative error {excess / ref:.2e} beyond storage rounding)")
        elif not torch.equal(_bits(s), _bits(v)):
            bad.append(k)
    return bad + [f"{k} (unexpected)" for k in sorted(set(stored) - set(case.tensors))]


def _bits(x: torch.Tensor) -> torch.Tensor:
    """A bf16 or float8 tensor as integers of its width (NaN slots compare equal bit for bit); others as they are."""
    return cache_bits(x) if x.dtype in (torch.bfloat16, torch.float8_e4m3fn) else x


def check_suite(spec: SuiteSpec, suite: Suite, device: str = "cpu", rel_tol: float = GOLDEN_REL_TOL,
                progress=None) -> list[str]:
    """The manifest against the config (config_drift), then every case regenerated in memory and compared
    with disk: inputs bit-identical, golden outputs within rel_tol of the largest magnitude (plus, for the
    float32-stored out, its storage rounding per element). Returns one problem line per difference."""
    problems = suite.config_drift(spec)
    on_disk = {e["name"]: e for e in suite.cases}
    for cs in spec.cases:
        if cs.name not in on_disk:
            continue
        stored = suite.load_case(on_disk[cs.name])
        case = generate_case(cs, device)
        bad = case_differences(stored, case, rel_tol)
        if bad:
            problems.append(f"{on_disk[cs.name]['file']}: differs in {', '.join(bad)}")
        if progress:
            progress(cs.name)
    return problems
