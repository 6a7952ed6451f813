"""Golden vector suites: generate, write (safetensors + manifest), load, integrity check.

A suite lives in one folder: one safetensors file per case and manifest.yaml (schema version, hash of the
generator sources, seeds, case specs, shapes, dtypes, tolerances, sha256 per file). A case holds
  inputs  q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask   (the kernel contract, docs/architecture.md §2)
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

Inputs are drawn from integer-seeded PCG64 streams and shaped with exact arithmetic only, so they
reproduce bit for bit on any machine. Unowned KV slots (spare pages, the tail of each request's last
page) hold NaN, and page-table entries past a request's last page point at a NaN page: a kernel that
reads out of range produces NaN instead of a plausible number.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kdev import cabi, ddtree, mla
from kdev.config import QK_DIM, CaseSpec, SuiteSpec, Tolerances, load_model, load_yaml
from kdev.errors import BadInput
from kdev.fsutil import atomic_write_bytes, make_temp_dir, remove_dead_writers_temps

SCHEMA_VERSION = 1
MANIFEST = "manifest.yaml"
INPUT_KEYS = ("q", "kv_cache", "page_table", "prefix_lens", "q_indptr", "tree_mask")
TREE_KEYS = ("tree_tokens", "tree_parents", "tree_depths", "tree_positions")
GOLDEN_KEYS = ("out", "lse")
ACCEPT_KEYS = ("accept_target", "accept_nodes", "accept_len", "bonus_token", "compact_rows")
_GENERATOR_SOURCES = ("mla.py", "ddtree.py", "vectors.py")


def generator_hash() -> str:
    """sha256 over the reference sources that determine a suite's contents."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in _GENERATOR_SOURCES:
        h.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------------- random inputs
def _normalish(rng: np.random.Generator, shape) -> np.ndarray:
    """Approximately N(0, 1) from four exact float32 uniforms (Irwin-Hall): no transcendental functions,
    so identical on every machine."""
    u = rng.random((4,) + tuple(shape), dtype=np.float32)
    return (u.sum(0, dtype=np.float32) - np.float32(2.0)) * np.float32(1.7320508)


def _bf16(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16)


@dataclass
class CaseData:
    spec: CaseSpec
    tensors: dict  # name -> torch tensor (CPU), as stored
    scale: float
    golden64: dict  # out and lse before storage rounding

    @property
    def trees_T(self) -> list[int]:
        ind = self.tensors["q_indptr"]
        return [int(ind[b + 1] - ind[b]) for b in range(len(ind) - 1)]


def make_trees(spec: CaseSpec, rng: np.random.Generator):
    """One tree per request (and its drafter distribution for DDTree cases)."""
    trees, dists = [], []
    t = spec.tree
    for _ in spec.prefix_lens:
        if t.kind == "ddtree":
            root = int(rng.integers(0, t.vocab))
            dist = ddtree.synthetic_drafter(rng, t.depth, t.topk, t.vocab, t.sharpness, t.ties)
            trees.append(ddtree.build_ddtree(dist, t.budget, root))
            dists.append(dist)
        else:
            tokens = rng.integers(0, 32000, t.nodes)
            if t.kind == "chain":
                trees.append(ddtree.chain_tree(t.nodes, tokens))
            elif t.kind == "star":
                trees.append(ddtree.star_tree(t.nodes, tokens))
            else:
                trees.append(ddtree.random_tree(rng, t.nodes, tokens))
    return trees, dists


def make_paged_kv(rng: np.random.Generator, lengths: list[int], page_size: int):
    """Shuffled physical pages, random bf16 rows where a request owns a slot, NaN everywhere else.
    Returns (kv_cache [P, page_size, 576] bf16, page_table [B, max_pages] int32)."""
    pages_needed = [max(1, -(-n // page_size)) for n in lengths]
    spare = max(2, sum(pages_needed) // 8)
    num_pages = sum(pages_needed) + spare
    perm = rng.permutation(num_pages).astype(np.int32)
    nan_page = int(perm[-1])  # a spare page: never owned, all NaN
    max_pages = max(pages_needed)
    page_table = np.full((len(lengths), max_pages), nan_page, np.int32)
    kv = np.full((num_pages, page_size, QK_DIM), np.nan, np.float32)
    nxt = 0
    for b, n in enumerate(lengths):
        own = perm[nxt:nxt + pages_needed[b]]
        nxt += pages_needed[b]
        page_table[b, :len(own)] = own
        rows = _normalish(rng, (n, QK_DIM))
        pos = np.arange(n)
        kv[cabi.kv_page_offset(own, pos, page_size)] = rows
    return _bf16(kv), torch.from_numpy(page_table)


def generate_case(spec: CaseSpec, device: str = "cpu") -> CaseData:
    """A case's inputs (CPU, bit-identical on every machine) and its float64 goldens computed on `device`."""
    return finish_case(generate_inputs(spec), device)


def generate_inputs(spec: CaseSpec) -> "CaseInputs":
    """Everything of a case but the attention goldens: inputs, trees, drafter distributions and the accept
    and compaction goldens. CPU only and picklable, so fuzz runs make these in worker processes."""
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    model = load_model(spec.model)
    trees, dists = make_trees(spec, rng)
    T = [t.size for t in trees]
    q_indptr = np.concatenate([[0], np.cumsum(T)]).astype(np.int32)
    n_q = int(q_indptr[-1])
    q = _bf16(_normalish(rng, (n_q, spec.heads, QK_DIM)))
    kv_cache, page_table = make_paged_kv(rng, [L + t for L, t in zip(spec.prefix_lens, T)], spec.page_size)
    tree_mask = torch.from_numpy(ddtree.batch_tree_mask(trees).view(np.int64))
    tensors = {
        "q": q,
        "kv_cache": kv_cache,
        "page_table": page_table,
        "prefix_lens": torch.tensor(spec.prefix_lens, dtype=torch.int32),
        "q_indptr": torch.from_numpy(q_indptr),
        "tree_mask": tree_mask,
        "tree_tokens": torch.from_numpy(np.concatenate([t.tokens for t in trees])),
        "tree_parents": torch.from_numpy(np.concatenate([t.parents for t in trees])),
        "tree_depths": torch.from_numpy(np.concatenate([t.depths for t in trees])),
        "tree_positions": torch.from_numpy(np.concatenate([t.positions(L) for t, L in zip(trees, spec.prefix_lens)])),
    }
    if dists:
        tensors["drafter_log_probs"] = torch.from_numpy(np.stack([d.log_probs for d in dists]))
        tensors["drafter_token_ids"] = torch.from_numpy(np.stack([d.token_ids for d in dists]))
    # the accept goldens draw from rng after the inputs: the same order as when the goldens came first
    tensors.update(accept_goldens(rng, trees, spec.prefix_lens, kv_cache, page_table))
    return CaseInputs(spec, tensors, model.softmax_scale)


@dataclass
class CaseInputs:
    spec: CaseSpec
    tensors: dict
    scale: float


def finish_case(inputs: CaseInputs, device: str = "cpu") -> CaseData:
    """Add the float64 reference's out and lse (computed on `device`) to a case's inputs."""
    t = inputs.tensors
    out, lse = mla.reference_verify_attn(t["q"], t["kv_cache"], t["page_table"], t["prefix_lens"],
                                         t["q_indptr"].numpy(), t["tree_mask"], inputs.scale, device=device)
    tensors = dict(t)
    tensors["out"], tensors["lse"] = out.cpu().to(torch.float32), lse.cpu()
    return CaseData(inputs.spec, tensors, inputs.scale, {"out": out.cpu(), "lse": lse.cpu()})


def accept_goldens(rng: np.random.Generator, trees: list, prefix_lens, kv_cache: torch.Tensor,
                   page_table: torch.Tensor) -> dict:
    """Golden outputs of the greedy accept walk and the KV compaction for a case. The target's argmax at a
    node is the token of one of its children 3 times in 4 (so walks go deep), else a random token.
    accept_nodes is padded to [B, T_max] with -1; compact_rows holds, request after request, the rows that
    land in slots prefix_len .. prefix_len + accept_len - 1 after compaction."""
    t_max = max(t.size for t in trees)
    targets, nodes, lens, bonus, rows = [], [], [], [], []
    kv_bits = kv_cache.view(torch.int16).numpy()
    for b, tree in enumerate(trees):
        children = [[] for _ in range(tree.size)]
        for i in range(1, tree.size):
            children[int(tree.parents[i])].append(i)
        tgt = np.empty(tree.size, np.int64)
        for i in range(tree.size):
            if children[i] and rng.random() < 0.75:
                tgt[i] = tree.tokens[children[i][int(rng.integers(0, len(children[i])))]]
            else:
                tgt[i] = rng.integers(0, 32000)
        acc = ddtree.accept_greedy(tree, tgt)
        compacted = ddtree.compact_kv(kv_bits, page_table[b].numpy(), int(prefix_lens[b]), acc.nodes)
        page_size = kv_cache.shape[1]
        for i in range(len(acc.nodes)):
            pos = int(prefix_lens[b]) + i
            page, offset = cabi.kv_page_offset(page_table[b], pos, page_size)
            rows.append(compacted[int(page), offset])
        targets.append(tgt)
        nodes.append(np.pad(acc.nodes, (0, t_max - len(acc.nodes)), constant_values=-1))
        lens.append(len(acc.nodes))
        bonus.append(acc.bonus_token)
    return {
        "accept_target": torch.from_numpy(np.concatenate(targets).astype(np.int32)),
        "accept_nodes": torch.from_numpy(np.stack(nodes).astype(np.int32)),
        "accept_len": torch.tensor(lens, dtype=torch.int32),
        "bonus_token": torch.tensor(bonus, dtype=torch.int32),
        "compact_rows": torch.from_numpy(np.stack(rows)).view(torch.bfloat16),
    }


def trees_of(tensors: dict) -> list[ddtree.Tree]:
    """The per-request trees of a case, rebuilt from its stored tensors."""
    ind = tensors["q_indptr"].tolist()
    return [ddtree.Tree(tensors["tree_tokens"][a:b].numpy(), tensors["tree_parents"][a:b].numpy(),
                        tensors["tree_depths"][a:b].numpy()) for a, b in zip(ind[:-1], ind[1:])]


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
    tmp = make_temp_dir(out_root, suite.name)
    try:
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
        if target.exists():
            old = make_temp_dir(out_root, suite.name, ".old")
            os.replace(target, old / suite.name)
        os.replace(tmp, target)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
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
    root = Path(root) if root else default_vectors_root()
    if (root / name_or_path / MANIFEST).is_file():
        return root / name_or_path
    places = " or ".join(map(str, dict.fromkeys([p, root / name_or_path])))  # one place for an absolute path
    raise BadInput(f"{name_or_path}: no suite there (no {MANIFEST} in {places}); "
                   f"generate it with 'kdev gen-refs --suite {p.name}'")


def default_vectors_root() -> Path:
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
        elif not torch.equal(s.view(torch.int16) if s.dtype == torch.bfloat16 else s,
                             v.view(torch.int16) if v.dtype == torch.bfloat16 else v):
            bad.append(k)
    return bad + [f"{k} (unexpected)" for k in sorted(set(stored) - set(case.tensors))]


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
