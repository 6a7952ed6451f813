"""The sweep: configs/bench.yaml -> shapes (the axes, the named sweeps, --shape and -a), their FLOPs and bytes, and
the measurement method and targets that the file sets."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kdev import cabi, registry
from kdev.config import CONFIG_DIR, LATENT_DIM, QK_DIM, TREE_KINDS, Tolerance, YamlReader, load_yaml
from kdev.errors import BadInput

AXES = ("batch", "prefix", "budget", "heads", "page_size", "tree", "requests", "budgets", "capture")
STRING_AXES = ("tree", "requests", "budgets", "capture")
# the verify calls (kdev/registry.py), each scheduled one also timed without its schedule (-layer), and the peers
ATTENTION_BACKENDS = (*registry.VERIFY_KERNELS, *registry.LAYER_BACKENDS, "triton", "torch-eager", "torch-sdpa",
                      "torch-flex")
TREE_BACKENDS = ("ddtree-build", "accept", "compact")  # the decoding round's other kernels
# a backend's lse (fp32, natural log) against the naive oracle's, where the backend returns one
PEER_LSE_TOLERANCE = Tolerance(atol=2e-3, rtol=2e-4, cos_diff=1e-8)
DEFAULT_AXES = {"batch": 1, "prefix": 32768, "budget": 64, "heads": 8, "page_size": 64, "tree": "ddtree",
                "requests": "", "budgets": "", "capture": ""}


# ---------------------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Shape:
    """One batch. A uniform one: `batch` requests of `prefix` tokens and a tree of `budget` nodes. A skewed one, as an
    engine makes them: `requests` COUNTxPREFIX groups joined by + (1x131072+15x2048) and `budgets` the trees' budgets
    (16/64/128) dealt to the requests in turn; batch, prefix and budget are then the count and the largest of each
    (the bounds a launch is planned for). `capture` PREFIX/BUDGET: the call is made with the bounds of a larger batch
    (max_kv_len PREFIX + BUDGET + 1, max_qlen BUDGET + 1), as a CUDA graph captured for that batch replays it here; such
    a shape is judged against its twin planned for its own lengths (which joins the sweep)."""

    batch: int
    prefix: int
    budget: int
    heads: int
    page_size: int = 64
    tree: str = "ddtree"
    requests: str = ""
    budgets: str = ""
    capture: str = ""

    @property
    def name(self) -> str:
        t = "" if self.tree == "ddtree" else f"-{self.tree}"
        skew = f"-R{self.requests}-N{self.budgets or self.budget}" if self.requests else ""
        cap = f"-C{self.capture}" if self.capture else ""
        return f"B{self.batch}-L{self.prefix}-N{self.budget}-H{self.heads}-p{self.page_size}{t}{skew}{cap}"

    @property
    def bounds(self) -> tuple | None:
        """(max_kv_len, max_qlen) of the capture this shape replays; None: its own."""
        if not self.capture:
            return None
        prefix, budget = parse_capture(self.capture)
        return prefix + budget + 1, budget + 1

    def own(self) -> "Shape":
        """The same batch planned for its own lengths (what a captured replay is judged against)."""
        return Shape(self.batch, self.prefix, self.budget, self.heads, self.page_size, self.tree, self.requests,
                     self.budgets)

    @property
    def T(self) -> int:
        return self.budget + 1

    @property
    def prefix_lens(self) -> tuple:
        """Each request's prefix, in batch order."""
        return parse_requests(self.requests) if self.requests else (self.prefix,) * self.batch

    @property
    def budget_list(self) -> tuple:
        """Each request's tree budget, in batch order."""
        every = parse_budgets(self.budgets) if self.budgets else (self.budget,)
        return tuple(every[i % len(every)] for i in range(self.batch))

    def alone(self) -> list["Shape"]:
        """The distinct requests of a skewed batch, each as a batch of one (what the batch is judged against)."""
        pairs = dict.fromkeys(zip(self.prefix_lens, self.budget_list))
        return [Shape(1, L, n, self.heads, self.page_size, self.tree, capture=self.capture) for L, n in pairs]

    def count(self, prefix: int, budget: int) -> int:
        return sum(1 for x in zip(self.prefix_lens, self.budget_list) if x == (prefix, budget))


def parse_requests(text: str) -> tuple:
    """'1x131072+15x2048' -> (131072, 2048, ..., 2048)."""
    out = []
    for group in text.replace(" ", "").split("+"):
        count, sep, prefix = group.partition("x")
        if not (sep and count.isdigit() and prefix.isdigit() and int(count) > 0):
            raise BadInput(f"requests {text!r}: {group!r} is not COUNTxPREFIX (e.g. 1x131072+15x2048)")
        out += [int(prefix)] * int(count)
    return tuple(out)


def parse_capture(text: str) -> tuple:
    """'131072/128' -> (131072, 128): the longest prefix and the largest budget a graph was captured for."""
    prefix, sep, budget = str(text).partition("/")
    if not (sep and prefix.isdigit() and budget.isdigit()):
        raise BadInput(f"capture {text!r}: PREFIX/BUDGET, the bounds a graph was captured for (e.g. 131072/128)")
    return int(prefix), int(budget)


def parse_budgets(text: str) -> tuple:
    """'16/64/128' -> (16, 64, 128)."""
    try:
        out = tuple(int(x) for x in str(text).split("/"))
    except ValueError:
        raise BadInput(f"budgets {text!r}: budgets joined by / (e.g. 16/64/128)") from None
    return out


def flops_bytes(tree_sizes: list[int], prefix_lens: list[int], heads: int) -> tuple[float, float]:
    flops = sum(2.0 * heads * t * (L + t) * (QK_DIM + LATENT_DIM) for t, L in zip(tree_sizes, prefix_lens))
    n_q = sum(tree_sizes)
    kv = sum((L + t) * QK_DIM * 2 for t, L in zip(tree_sizes, prefix_lens))
    return flops, kv + n_q * heads * QK_DIM * 2 + n_q * heads * LATENT_DIM * 2


@dataclass(frozen=True)
class Method:
    warmup: int = 3
    min_samples: int = 10
    max_samples: int = 200
    target_rel_spread: float = 0.005
    max_seconds: float = 4.0
    l2_flush_factor: int = 2
    tolerance: Tolerance = Tolerance(atol=2e-2, rtol=4e-2, cos_diff=4e-5)
    graph: bool = False  # time the replay of a CUDA graph that holds one call (how a server runs decode)


@dataclass(frozen=True)
class BenchConfig:
    method: Method
    backends: tuple
    sweeps: dict  # name -> (description, [Shape])
    sweep_backends: dict = field(default_factory=dict)  # name -> backends a sweep names for itself
    # what the kernels are judged against (a shape's `target_us`, a sweep's `min_naive_speedup`): reported, not gated
    targets_us: dict = field(default_factory=dict)  # shape name -> time to meet, µs
    min_naive_speedup: dict = field(default_factory=dict)  # shape name -> how many times faster than naive
    # shape name -> the GPU (its configs/gpus.yaml name) its target_us is set for: a time on another GPU is reported
    # against it as indicative only
    target_gpu: dict = field(default_factory=dict)


def _shape(r: YamlReader, base: dict) -> tuple[Shape, float | None]:
    vals = dict(base)
    for k in AXES:
        if k in r.data:
            vals[k] = str(r.get(k, (str, int))) if k in STRING_AXES else r.get(k, int)
    target = r.get("target_us", float, None, lambda v: v > 0, "must be > 0")
    r.done()
    return _make_shape(vals, f"{r.file}: {r.where}"), target


def _make_shape(vals: dict, where: str) -> Shape:
    vals = {**DEFAULT_AXES, **vals}
    if vals["requests"]:  # a skewed batch: its bounds from its requests
        try:
            lens = parse_requests(vals["requests"])
            budgets = parse_budgets(vals["budgets"]) if vals["budgets"] else (vals["budget"],)
        except BadInput as e:
            raise BadInput(f"{where}: {e}") from None
        vals.update(batch=len(lens), prefix=max(lens), budget=max(budgets))
    elif vals["budgets"]:
        raise BadInput(f"{where}: budgets {vals['budgets']!r} takes requests (a skewed batch)")
    s = Shape(**{k: vals[k] for k in AXES})
    for L, n in zip(s.prefix_lens, s.budget_list) if s.requests else [(s.prefix, s.budget)]:
        problem = cabi.shape_problem(s.batch, L, n, s.heads, s.page_size)
        if problem:
            raise BadInput(f"{where}: shape {s.name} out of range: {problem}")
    if s.tree not in TREE_KINDS:
        raise BadInput(f"{where}: shape {s.name}: tree {s.tree!r} is not one of {'/'.join(TREE_KINDS)}")
    if s.capture:
        try:
            prefix, budget = parse_capture(s.capture)
        except BadInput as e:
            raise BadInput(f"{where}: {e}") from None
        if prefix < s.prefix or budget < s.budget:
            raise BadInput(f"{where}: shape {s.name}: capture {s.capture} is smaller than the batch (prefix {s.prefix}, "
                           f"budget {s.budget}): a graph replays batches within its capture's bounds")
        problem = cabi.shape_problem(1, prefix, budget, s.heads, s.page_size)
        if problem:
            raise BadInput(f"{where}: capture {s.capture} out of range: {problem}")
    return s


def _product(axes: dict) -> list[dict]:
    keys = list(axes)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(axes[k] for k in keys))]


def load_bench(path: str | Path | None = None) -> BenchConfig:
    path = Path(path) if path else CONFIG_DIR / "bench.yaml"
    top = YamlReader(load_yaml(path), path, "")
    m = top.sub("method", {})
    tol = m.sub("tolerance", {})
    d = Method()
    method = Method(
        warmup=m.get("warmup", int, d.warmup), min_samples=m.positive_int("min_samples", d.min_samples),
        max_samples=m.positive_int("max_samples", d.max_samples),
        target_rel_spread=m.get("target_rel_spread", float, d.target_rel_spread),
        max_seconds=m.get("max_seconds", float, d.max_seconds),
        l2_flush_factor=m.positive_int("l2_flush_factor", d.l2_flush_factor),
        graph=m.get("graph", bool, d.graph),
        tolerance=Tolerance(atol=tol.get("atol", float, d.tolerance.atol), rtol=tol.get("rtol", float, d.tolerance.rtol),
                            cos_diff=tol.get("cos_diff", float, d.tolerance.cos_diff)))
    tol.done()
    m.done()
    backends = tuple(top.get("backends", list, [registry.DEFAULT, registry.ORACLE, "torch-eager", "torch-sdpa"]))
    sw = top.sub("sweeps")
    top.done()
    sweeps, sweep_backends, targets_us, min_speedup, target_gpu = {}, {}, {}, {}, {}
    gpus = None
    for name in list(sw.data):
        s = sw.sub(name)
        desc = s.get("description", str, "")
        speedup = s.get("min_naive_speedup", float, None, lambda v: v > 0, "must be > 0")
        set_for = s.get("target_gpu", str, None)
        if set_for is not None:
            from kdev.config import load_gpus

            gpus = gpus or load_gpus()
            if set_for not in gpus:
                raise s.fail("target_gpu", f"{set_for!r} is not in configs/gpus.yaml (have: {', '.join(gpus)})")
            set_for = gpus[set_for].name
        if "backends" in s.data:
            sweep_backends[name] = tuple(s.get("backends", list))
        shapes = []
        if "axes" in s.data:
            a = s.sub("axes")
            axes = {k: a.get(k, list, check=lambda v: len(v) > 0, check_msg="a non-empty list") for k in list(a.data)}
            unknown = set(axes) - set(AXES)
            if unknown:
                raise a.fail(sorted(unknown)[0], "unknown axis")
            a.done()
            shapes += [_make_shape({**DEFAULT_AXES, **combo}, f"{path}: sweeps.{name}") for combo in _product(axes)]
        if "vary" in s.data:  # one axis at a time around a center shape
            center = {**DEFAULT_AXES, **s.get("center", dict, {})}
            v = s.sub("vary")
            for axis in list(v.data):
                if axis not in AXES:
                    raise v.fail(axis, "unknown axis")
                for value in v.get(axis, list):
                    shapes.append(_make_shape({**center, axis: value}, f"{path}: sweeps.{name}.vary.{axis}"))
            v.done()
        for i, raw in enumerate(s.get("shapes", list, [])):
            where = f"sweeps.{name}.shapes[{i}]"
            shape, target = _shape(YamlReader(raw, path, where), DEFAULT_AXES)
            shapes.append(shape)
            if target is not None:
                if targets_us.get(shape.name, target) != target:
                    raise BadInput(f"{path}: {where}: {shape.name} has target_us {targets_us[shape.name]:g} elsewhere")
                if target_gpu.get(shape.name, set_for) != set_for:
                    raise BadInput(f"{path}: {where}: {shape.name} has a target set for {target_gpu[shape.name]} "
                                   "elsewhere")
                targets_us[shape.name] = target
                if set_for is not None:
                    target_gpu[shape.name] = set_for
        s.done()
        if not shapes:
            raise BadInput(f"{path}: sweeps.{name}: needs axes or shapes")
        sweeps[name] = (desc, list(dict.fromkeys(shapes)))
        if speedup is not None:
            min_speedup.update({sh.name: speedup for sh in shapes})
    sw.done()
    known = set(ATTENTION_BACKENDS) | set(TREE_BACKENDS)
    for name, bks in [("backends", backends), *((f"sweeps.{k}.backends", v) for k, v in sweep_backends.items())]:
        bad = [b for b in bks if b not in known]
        if bad:
            raise BadInput(f"{path}: {name}: unknown backend {bad[0]!r} (have {', '.join(sorted(known))})")
    return BenchConfig(method, backends, sweeps, sweep_backends, targets_us, min_speedup, target_gpu)


def parse_assignments(items: list[str], what: str) -> dict:
    """['B=1', 'L=4096,8192'] -> {'batch': [1], 'prefix': [4096, 8192]} (short or long axis names)."""
    alias = {"b": "batch", "l": "prefix", "n": "budget", "h": "heads", "page": "page_size", "p": "page_size"}
    out = {}
    for item in items:
        for part in item.split(";") if ";" in item else [item]:
            if "=" not in part:
                raise BadInput(f"{what}: {part!r} is not AXIS=VALUES")
            k, v = part.split("=", 1)
            k = alias.get(k.strip().lower(), k.strip().lower())
            if k not in AXES:
                raise BadInput(f"{what}: unknown axis {k!r} (axes: {', '.join(AXES)})")
            if k in out:  # the first value would be dropped without a word
                raise BadInput(f"{what}: axis {k!r} given twice")
            try:
                out[k] = [x.strip() if k in STRING_AXES else int(x) for x in v.split(",") if x.strip()]
            except ValueError:
                raise BadInput(f"{what}: {part!r}: values must be integers") from None
            if not out[k]:  # an axis without values would leave no shape to run
                raise BadInput(f"{what}: {part!r}: no values")
    return out


def expand(cfg: BenchConfig, sweep: str | None, shape: list[str] | None, overrides: list[str] | None) -> list[Shape]:
    """The shapes to run: a named sweep (with -a AXIS=V1,V2 replacing that axis everywhere) or --shape."""
    if shape:
        if sweep:
            raise BadInput(f"--shape and --sweep {sweep}: give one of them (-a AXIS=V1,V2 varies either)")
        base = []
        for s in shape:
            vals = parse_assignments([s.replace(",", ";") if s.count("=") > 1 else s], "--shape")
            many = [k for k, v in vals.items() if len(v) > 1]
            if many:
                raise BadInput(f"--shape {s}: one value per axis ({many[0]} has {len(vals[many[0]])}); "
                               f"-a {many[0]}=V1,V2 runs several")
            base.append({**DEFAULT_AXES, **{k: v[0] for k, v in vals.items()}})
        rows = base
    else:
        name = sweep or "smoke"
        if name not in cfg.sweeps:
            raise BadInput(f"no sweep named {name!r} (have: {', '.join(cfg.sweeps)})")
        rows = [asdict(s) for s in cfg.sweeps[name][1]]
    ov = parse_assignments(overrides or [], "-a")
    if ov:
        rows = [{**r, **combo} for r in rows for combo in _product(ov)]
    shapes = [_make_shape(r, "--shape") for r in rows]
    # a skewed batch is judged against its requests timed alone, a captured replay against its twin planned for its own
    # lengths: they run in the same sweep, after it
    shapes = list(dict.fromkeys([*shapes, *(a for s in shapes if s.requests for a in s.alone())]))
    return list(dict.fromkeys([*shapes, *(s.own() for s in shapes if s.capture)]))
