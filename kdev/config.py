"""YAML in configs/ -> validated, frozen dataclasses.

Every loader checks every field and rejects unknown keys; an error names the file and the key path in
one line (raised as BadInput, exit 2).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kdev import cabi
from kdev.errors import BadInput
from kdev.project import REPO_ROOT, WORK_ROOT  # where kdev reads and writes (kdev/project.py)

CONFIG_DIR = REPO_ROOT / "configs"

# The contract's limits, as kernels/include/kdev/kdtree.h states them (read by kdev/cabi.py).
LATENT_DIM, ROPE_DIM, QK_DIM = cabi.LATENT_DIM, cabi.ROPE_DIM, cabi.QK_DIM
MAX_BUDGET, MAX_DEPTH, MAX_PREFIX = cabi.MAX_BUDGET, cabi.MAX_DEPTH, cabi.MAX_PREFIX
TREE_KINDS = ("ddtree", "chain", "star", "random")


# --------------------------------------------------------------------------------------------- helpers
class YamlReader:
    """Reads one mapping of a YAML file, remembering where it is for error messages."""

    def __init__(self, data: Any, file: Path, where: str):
        if not isinstance(data, dict):
            raise BadInput(f"{file}: {where or 'top level'}: expected a mapping, got {type(data).__name__}")
        self.data, self.file, self.where, self.used = data, file, where, set()

    def _key(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, msg: str) -> BadInput:
        return BadInput(f"{self.file}: {self._key(key)}: {msg}")

    def get(self, key: str, kind: type | tuple, default: Any = ..., check=None, check_msg: str = ""):
        self.used.add(key)
        if key not in self.data:
            if default is ...:
                raise self.fail(key, "missing")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            names = "/".join(k.__name__ for k in kinds)
            raise self.fail(key, f"expected {names}, got {value!r}")
        if check is not None and not check(value):
            raise self.fail(key, f"{check_msg} (got {value!r})")
        return value

    def positive_int(self, key: str, default: Any = ..., maximum: int | None = None) -> int:
        ok = (lambda v: 0 < v <= maximum) if maximum else (lambda v: v > 0)
        msg = f"must be in 1..{maximum}" if maximum else "must be > 0"
        return self.get(key, int, default, ok, msg)

    def sub(self, key: str, default: Any = ...) -> "YamlReader":
        self.used.add(key)
        if key not in self.data:
            if default is ...:
                raise self.fail(key, "missing")
            return YamlReader(default, self.file, self._key(key))
        return YamlReader(self.data[key], self.file, self._key(key))

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            raise self.fail(str(unknown[0]), "unknown key")


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, mark):
        super().__init__(f"duplicate key {key!r}")
        self.key, self.mark = key, mark


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load's loader that refuses a key given twice in one mapping (at any depth), where PyYAML keeps the last
    one silently: a second `suites:` would drop every suite of the first. A merge key (`<<: *base`) that an explicit
    key overrides is not a duplicate."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise _DuplicateKey(key, key_node.start_mark)
                    seen.add(key)
                except TypeError:  # an unhashable key: SafeLoader's own error says so
                    pass
        return super().construct_mapping(node, deep)


def load_yaml(path: Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"{path}: no such config file")
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except _DuplicateKey as e:
        raise BadInput(f"{path}: duplicate key {e.key!r} (line {e.mark.line + 1}, column {e.mark.column + 1}): "
                       "each key once") from None
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise BadInput(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} on line {line})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise BadInput(f"{path}: malformed YAML{where}: {getattr(e, 'problem', e)}") from None


# ---------------------------------------------------------------------------------------------- models
@dataclass(frozen=True)
class YarnConfig:
    factor: float
    original_max_position_embeddings: int
    mscale: float
    mscale_all_dim: float
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class ModelConfig:
    name: str
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    yarn: YarnConfig
    heads_per_gpu: dict = field(default_factory=dict)

    @property
    def softmax_scale(self) -> float:
        """(qk_nope + qk_rope)^-0.5, times the YaRN attention factor squared (DeepSeek-V3 convention)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.yarn.factor > 1.0 and self.yarn.mscale_all_dim:
            m = 0.1 * self.yarn.mscale_all_dim * math.log(self.yarn.factor) + 1.0
            scale *= m * m
        return scale


def load_model(name_or_path: str | Path) -> ModelConfig:
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml") and "/" not in str(name_or_path):
        path = CONFIG_DIR / "models" / f"{name_or_path}.yaml"
    r = YamlReader(load_yaml(path), path, "")
    y = r.sub("yarn")
    yarn = YarnConfig(
        factor=y.get("factor", float, check=lambda v: v >= 1.0, check_msg="must be >= 1"),
        original_max_position_embeddings=y.positive_int("original_max_position_embeddings"),
        mscale=y.get("mscale", float),
        mscale_all_dim=y.get("mscale_all_dim", float),
        beta_fast=y.get("beta_fast", float, 32.0),
        beta_slow=y.get("beta_slow", float, 1.0),
    )
    y.done()
    hp = r.sub("heads_per_gpu", {})
    heads_per_gpu = {k: hp.positive_int(k) for k in list(hp.data)}
    hp.done()
    model = ModelConfig(
        name=r.get("name", str),
        num_heads=r.positive_int("num_heads"),
        q_lora_rank=r.positive_int("q_lora_rank"),
        kv_lora_rank=r.get("kv_lora_rank", int, check=lambda v: v == LATENT_DIM, check_msg=f"kernels need {LATENT_DIM}"),
        qk_nope_head_dim=r.positive_int("qk_nope_head_dim"),
        qk_rope_head_dim=r.get("qk_rope_head_dim", int, check=lambda v: v == ROPE_DIM, check_msg=f"kernels need {ROPE_DIM}"),
        v_head_dim=r.positive_int("v_head_dim"),
        rope_theta=r.get("rope_theta", float, check=lambda v: v > 0, check_msg="must be > 0"),
        yarn=yarn,
        heads_per_gpu=heads_per_gpu,
    )
    r.done()
    return model


# ---------------------------------------------------------------------------------------------- suites
@dataclass(frozen=True)
class TreeSpec:
    """How a request's draft tree is made. ddtree uses budget/depth/topk/vocab/sharpness/ties;
    chain, star and random use nodes (T, root included). ragged: each request draws its own size, a budget in 1..budget
    (nodes in 1..nodes), so one batch holds trees of different sizes as an engine's does."""

    kind: str
    nodes: int = 0
    budget: int = 0
    depth: int = 0
    topk: int = 0
    vocab: int = 0
    sharpness: float = 1.0
    ties: bool = False
    ragged: bool = False

    def to_dict(self) -> dict:
        ragged = {"ragged": True} if self.ragged else {}  # absent where false: the specs written before it read the same
        if self.kind == "ddtree":
            return dict(kind=self.kind, budget=self.budget, depth=self.depth, topk=self.topk, vocab=self.vocab,
                        sharpness=self.sharpness, ties=self.ties, **ragged)
        return dict(kind=self.kind, nodes=self.nodes, **ragged)


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    cos_diff: float

    def to_dict(self) -> dict:
        return dict(atol=self.atol, rtol=self.rtol, cos_diff=self.cos_diff)


@dataclass(frozen=True)
class Tolerances:
    out: Tolerance
    lse: Tolerance

    def to_dict(self) -> dict:
        return dict(out=self.out.to_dict(), lse=self.lse.to_dict())

    @staticmethod
    def from_dict(d: dict) -> "Tolerances":
        return Tolerances(out=Tolerance(**d["out"]), lse=Tolerance(**d["lse"]))


@dataclass(frozen=True)
class CaseSpec:
    name: str
    prefix_lens: tuple
    tree: TreeSpec
    heads: int
    page_size: int
    seed: int
    model: str
    tolerances: Tolerances
    kv_dtype: str = "bf16"  # KV_CACHE_DTYPES: the cache's dtype (kdtree.h kv_dtype)
    kv_scale: float = 0.0  # e4m3: the cache's scale (a row's values are the stored ones times it); bf16: 0

    @property
    def batch(self) -> int:
        return len(self.prefix_lens)

    def to_dict(self) -> dict:
        # the cache's dtype only where it is not bf16: the specs written before it read the same
        kv = {"kv_cache": {"dtype": self.kv_dtype, "scale": self.kv_scale}} if self.kv_dtype != "bf16" else {}
        return dict(name=self.name, prefix_lens=list(self.prefix_lens), tree=self.tree.to_dict(),
                    heads=self.heads, page_size=self.page_size, seed=self.seed, model=self.model, **kv)


@dataclass(frozen=True)
class SuiteSpec:
    name: str
    description: str
    cases: tuple


def _tree_spec(r: YamlReader) -> TreeSpec:
    kind = r.get("kind", str, check=lambda v: v in TREE_KINDS, check_msg=f"must be one of {', '.join(TREE_KINDS)}")
    if kind == "ddtree":
        budget = r.positive_int("budget", maximum=MAX_BUDGET)
        depth = r.positive_int("depth", maximum=MAX_DEPTH)
        vocab = r.positive_int("vocab", 32000)
        topk = r.positive_int("topk", min(budget, vocab), maximum=vocab)
        spec = TreeSpec(kind, budget=budget, depth=depth, topk=topk, vocab=vocab,
                        sharpness=r.get("sharpness", float, 1.0, lambda v: v > 0, "must be > 0"),
                        ties=r.get("ties", bool, False), ragged=r.get("ragged", bool, False))
    else:
        spec = TreeSpec(kind, nodes=r.positive_int("nodes", maximum=MAX_BUDGET + 1), ragged=r.get("ragged", bool, False))
    r.done()
    return spec


def _tolerance(r: YamlReader, default: Tolerance) -> Tolerance:
    nonneg = (lambda v: v >= 0, "must be >= 0")
    t = Tolerance(atol=r.get("atol", float, default.atol, *nonneg), rtol=r.get("rtol", float, default.rtol, *nonneg),
                  cos_diff=r.get("cos_diff", float, default.cos_diff, *nonneg))
    r.done()
    return t


# The KV cache dtypes a case may have (kdtree.h's KDTREE_KV_BF16 and KDTREE_KV_FP8_E4M3), by their suites.yaml names.
KV_CACHE_DTYPES = ("bf16", "e4m3")


def _kv_cache(r: YamlReader) -> tuple[str, float]:
    """A case's `kv_cache: {dtype: e4m3, scale: S}` (absent: bf16). The scale must let the generator's rows fit e4m3
    (cases.E4M3_MIN_SCALE: no value saturates)."""
    from kdev.cases import E4M3_MIN_SCALE

    dtype = r.get("dtype", str, "bf16", lambda v: v in KV_CACHE_DTYPES,
                  f"must be one of {', '.join(KV_CACHE_DTYPES)} (kdtree.h: {cabi.C['KDTREE_KV_DTYPE_RULE']})")
    if dtype == "bf16":
        r.done()
        return dtype, 0.0
    scale = r.get("scale", float, 1.0, lambda v: math.isfinite(v) and v >= E4M3_MIN_SCALE,
                  f"must be finite and >= {E4M3_MIN_SCALE:.6g} (the generator's largest value over e4m3's 448)")
    r.done()
    return dtype, scale


# bf16 outputs: one rounding is 2^-9 relative; the flash kernel also rounds P to bf16 before P·V.
DEFAULT_TOLERANCES = Tolerances(out=Tolerance(atol=1e-2, rtol=2e-2, cos_diff=1e-5),
                                lse=Tolerance(atol=1e-3, rtol=1e-4, cos_diff=1e-9))


def _tolerances(r: YamlReader, default: Tolerances) -> Tolerances:
    t = Tolerances(out=_tolerance(r.sub("out", {}), default.out), lse=_tolerance(r.sub("lse", {}), default.lse))
    r.done()
    return t


def load_suites(path: str | Path | None = None) -> dict[str, SuiteSpec]:
    path = Path(path) if path else CONFIG_DIR / "suites.yaml"
    top = YamlReader(load_yaml(path), path, "")
    d = top.sub("defaults", {})
    default_model = d.get("model", str, "kimi-k2.6")
    default_tol = _tolerances(d.sub("tolerances", {}), DEFAULT_TOLERANCES)
    d.done()
    suites_r = top.sub("suites")
    top.done()
    suites = {}
    for sname in list(suites_r.data):
        s = suites_r.sub(sname)
        suite_tol = _tolerances(s.sub("tolerances", {}), default_tol)
        description = s.get("description", str, "")
        raw_cases = s.get("cases", list, check=lambda v: len(v) > 0, check_msg="needs at least one case")
        cases, names = [], set()
        for i, raw in enumerate(raw_cases):
            c = YamlReader(raw, path, f"suites.{sname}.cases[{i}]")
            name = c.get("name", str, check=lambda v: v.replace("-", "").replace("_", "").isalnum(),
                          check_msg="letters, digits, '-' and '_' only")
            if name in names:
                raise c.fail("name", f"duplicate case name {name!r}")
            names.add(name)
            prefix_lens = c.get("prefix_lens", list, check=lambda v: len(v) > 0, check_msg="needs at least one request")
            for j, L in enumerate(prefix_lens):
                if not isinstance(L, int) or isinstance(L, bool) or not 0 <= L <= MAX_PREFIX:
                    raise c.fail(f"prefix_lens[{j}]", f"must be an integer in 0..{MAX_PREFIX} (got {L!r})")
            tree = _tree_spec(c.sub("tree"))
            cases.append(CaseSpec(
                name=name, prefix_lens=tuple(prefix_lens), tree=tree,
                heads=c.positive_int("heads", maximum=128),
                page_size=c.get("page_size", int, 1, lambda v: cabi.page_size_problem(v) is None,
                                f"must be a power of two in 1..{cabi.MAX_PAGE_SIZE} (kdtree.h's page rule)"),
                seed=c.get("seed", int, check=lambda v: v >= 0, check_msg="must be >= 0"),
                model=c.get("model", str, default_model),
                tolerances=_tolerances(c.sub("tolerances", {}), suite_tol),
                **dict(zip(("kv_dtype", "kv_scale"), _kv_cache(c.sub("kv_cache", {})))),
            ))
            c.done()
        s.done()
        suites[sname] = SuiteSpec(name=sname, description=description, cases=tuple(cases))
    suites_r.done()
    return suites


def load_suite(name: str, path: str | Path | None = None) -> SuiteSpec:
    suites = load_suites(path)
    if name not in suites:
        raise BadInput(f"{path or CONFIG_DIR / 'suites.yaml'}: no suite named {name!r} (have: {', '.join(suites)})")
    return suites[name]


# ----------------------------------------------------------------------------------------------- build
@dataclass(frozen=True)
class BuildConfig:
    archs: tuple
    flags: tuple
    output_dir: Path
    allow_spills: bool
    smem_limit_bytes: dict
    path: Path
    # the archs build.yaml names (an --arch override builds others): only a build of these is the default library
    # (build/latest.json); every build is also the latest of its own arch set (build/latest-<archs>.json)
    default_archs: tuple = ()


# The one arch whose code holds the wgmma kernels (their bodies compile under __CUDA_ARCH_FEAT_SM90_ALL,
# kernels/include/kdev/wgmma.cuh); an sm_90 GPU runs it.
WGMMA_ARCH = "sm_90a"


def _arch_ok(a) -> bool:
    """sm_ and a two- or three-digit compute capability (sm_90, sm_120), optionally arch-specific (sm_90a)."""
    return isinstance(a, str) and re.fullmatch(r"sm_[1-9][0-9]{1,2}a?", a) is not None


def load_build(path: str | Path | None = None, archs: list[str] | None = None) -> BuildConfig:
    path = Path(path) if path else CONFIG_DIR / "build.yaml"
    r = YamlReader(load_yaml(path), path, "")
    cfg_archs = r.get("archs", list, check=lambda v: len(v) > 0 and all(map(_arch_ok, v)),
                      check_msg="a non-empty list like [sm_90, sm_120]")
    flags = r.get("flags", list, check=lambda v: all(isinstance(f, str) for f in v), check_msg="a list of strings")
    out = Path(r.get("output_dir", str, "build"))
    allow_spills = r.get("allow_spills", bool, False)
    lim = r.sub("smem_limit_bytes", {})
    limits = {k: lim.positive_int(k) for k in list(lim.data)}
    lim.done()
    r.done()
    if archs:
        bad = [a for a in archs if not _arch_ok(a)]
        if bad:
            raise BadInput(f"--arch: {bad[0]!r} is not an arch like sm_90")
    return BuildConfig(archs=tuple(dict.fromkeys(archs or cfg_archs)), flags=tuple(flags),
                       output_dir=out if out.is_absolute() else WORK_ROOT / out, allow_spills=allow_spills,
                       smem_limit_bytes=limits, path=path, default_archs=tuple(dict.fromkeys(cfg_archs)))


# ------------------------------------------------------------------------------------------------ GPUs
@dataclass(frozen=True)
class Rate:
    """One figure of configs/gpus.yaml's rates: known ({value}: low == high) or a range ({low, high}), with its source."""

    low: float
    high: float
    source: str = ""
    measured: bool = False

    @property
    def nominal(self) -> float:
        return (self.low + self.high) / 2


RATE_NAMES = ("clock_mhz", "smem_bytes_per_clk", "l2_bytes_per_clk", "issue_per_clk", "l2_mb")


@dataclass(frozen=True)
class GpuSpec:
    """What a launch plan depends on, for a GPU that need not be here (configs/gpus.yaml) or the one that is."""

    key: str
    name: str
    arch: str
    sms: int
    smem_per_block_optin: int
    smem_per_sm: int
    threads_per_sm: int
    registers_per_sm: int
    flops: float | None = None  # ceilings: bf16 mma.sync FLOP/s and memory bytes/s
    bytes_per_s: float | None = None
    ceilings_measured: bool = False
    ceilings_source: str = ""
    ceilings_clock_mhz: float | None = None  # the SM clock the flops ceiling holds at
    rates: dict | None = None  # RATE_NAMES -> Rate: what kdev plan --project prices SASS with
    # dense e4m3 tensor-core FLOP/s (fp32 accumulate), a Rate in FLOP/s with its source: what an e4m3-math kernel could
    # reach (kernels/NOTES.md "FP8 cache: the prediction")
    e4m3_flops: Rate | None = None
    memory_bytes: Rate | None = None  # device memory, bytes (what holds the weights and the KV cache: kdev plan)

    @property
    def major(self) -> int:
        return int(self.arch[3:].rstrip("a")) // 10


def load_gpus(path: str | Path | None = None) -> dict[str, GpuSpec]:
    path = Path(path) if path else CONFIG_DIR / "gpus.yaml"
    top = YamlReader(load_yaml(path), path, "")
    gpus = top.sub("gpus")
    out = {}
    for key in list(gpus.data):
        r = gpus.sub(key)
        arch = r.get("arch", str, check=_arch_ok, check_msg="an arch like sm_90")
        spec = dict(key=key, name=r.get("name", str), arch=arch, sms=r.positive_int("sms"),
                    smem_per_block_optin=r.positive_int("smem_per_block_optin"),
                    smem_per_sm=r.positive_int("smem_per_sm"), threads_per_sm=r.positive_int("threads_per_sm"),
                    registers_per_sm=r.positive_int("registers_per_sm"))
        if "ceilings" in r.data:
            c = r.sub("ceilings")
            positive = dict(check=lambda v: v > 0, check_msg="must be > 0")
            spec.update(flops=c.get("tflops", float, **positive) * 1e12,
                        bytes_per_s=c.get("gbps", float, **positive) * 1e9,
                        ceilings_measured=c.get("measured", bool), ceilings_source=c.get("source", str, ""),
                        ceilings_clock_mhz=c.get("clock_mhz", (int, float), None, **positive))
            c.done()
        if "rates" in r.data:
            spec["rates"] = _rates(r.sub("rates"))
        if "e4m3_tflops" in r.data:
            spec["e4m3_flops"] = _rate(r.sub("e4m3_tflops"), 1e12)
        if "memory_gib" in r.data:
            spec["memory_bytes"] = _rate(r.sub("memory_gib"), 2.0**30)
        r.done()
        out[key] = GpuSpec(**spec)
    gpus.done()
    top.done()
    return out


def _rate(x: "YamlReader", unit: float = 1.0) -> Rate:
    """One figure: {value: X} or {low: A, high: B}, with its source (and measured), in the file's unit times `unit`."""
    positive = dict(check=lambda v: v > 0, check_msg="must be > 0")
    if "value" in x.data:
        low = high = float(x.get("value", (int, float), **positive))
    else:
        low, high = float(x.get("low", (int, float), **positive)), float(x.get("high", (int, float), **positive))
        if low > high:
            raise x.fail("low", f"{low:g} is above high {high:g}")
    rate = Rate(low * unit, high * unit, x.get("source", str), x.get("measured", bool, False))
    x.done()
    return rate


def _rates(r: "YamlReader") -> dict:
    out = {name: _rate(r.sub(name)) for name in RATE_NAMES}
    r.done()
    return out
