"""The torch-facing side of the C ABI: tensor checks, params filled from tensors, calls on the current stream.

The ABI itself (structs, signatures, status codes, the contract's constants) is kdev/cabi.py, read from
kernels/include/kdev/kdtree.h; this module adds what needs torch. Tensor arguments are checked here (device, dtype,
shape, contiguity, alignment, the page rule) and a clear Python error is raised before anything is called; the C side
validates again and never launches on bad arguments. Loading a library built from other sources than the current
kernels/ warns (StaleLibraryWarning).
"""

from __future__ import annotations

import ctypes
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from kdev import build as kbuild
from kdev import cabi, config, refs, registry
from kdev.cabi import LATENT_DIM, QK_DIM
from kdev.errors import BadInput, EnvironmentMissing

# the verify calls, their entry points and kinds: kdev/registry.py (one table)
VERIFY_KERNELS = registry.VERIFY_KERNELS
SCHEDULED_KERNELS = registry.SCHEDULED
SPLIT_KV_KERNELS = registry.SPLIT_KV  # a workspace and a split count
WGMMA_KERNELS = registry.WGMMA_ONLY  # answer 4 (not on this GPU) where the loaded code has no wgmma kernel
FLASH_KERNELS = tuple(k for k in SPLIT_KV_KERNELS if k not in WGMMA_KERNELS)  # the split-KV calls every build runs


class KernelError(RuntimeError):
    """A non-zero status from the library, with kdtree_last_error()."""

    def __init__(self, fn: str, status: int, message: str):
        super().__init__(f"{fn}: status {status} ({cabi.status_text(status)}): {message}")
        self.fn, self.status, self.message = fn, status, message


class AbiArgumentError(ValueError):
    """A tensor argument that the contract rejects, caught before the call."""


class StaleLibraryWarning(UserWarning):
    pass


def _check(name: str, t: torch.Tensor, dtype, ndim: int, device: torch.device, align: int = 16):
    if not isinstance(t, torch.Tensor):
        raise AbiArgumentError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise AbiArgumentError(f"{name}: on {t.device}, expected {device}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise AbiArgumentError(f"{name}: dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    if t.dim() != ndim:
        raise AbiArgumentError(f"{name}: {t.dim()} dims {tuple(t.shape)}, expected {ndim}")
    if not t.is_contiguous():
        raise AbiArgumentError(f"{name}: not contiguous")
    if t.data_ptr() % align:
        raise AbiArgumentError(f"{name}: data pointer not {align}-byte aligned")


@dataclass
class VerifyInputs:
    """The contract's inputs for one call (kdtree.h; docs/architecture.md), on one CUDA device."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    page_table: torch.Tensor
    prefix_lens: torch.Tensor
    q_indptr: torch.Tensor
    tree_mask: torch.Tensor
    scale: float
    max_qlen: int | None = None  # host-side bounds; computed (one host sync) when None
    max_kv_len: int | None = None
    # an e4m3 cache's scale (kdtree.h KDTREE_KV_FP8_E4M3): a row's values are the stored ones times it; None reads as
    # 1.0 there (SGLang's uncalibrated layer.k_scale). A bf16 cache takes none (None, 0 or 1).
    kv_scale: float | None = None

    @staticmethod
    def from_case(tensors: dict, scale: float, device) -> "VerifyInputs":
        kv_scale = float(tensors["kv_scale"].reshape(-1)[0]) if "kv_scale" in tensors else None  # e4m3 cases only
        return VerifyInputs(*(tensors[k].to(device).contiguous() for k in
                              ("q", "kv_cache", "page_table", "prefix_lens", "q_indptr", "tree_mask")), scale=scale,
                            kv_scale=kv_scale)


# The KV cache dtypes of the contract (kdtree.h): torch dtype -> kv_dtype code. Every other dtype is refused; an 8-bit or
# narrower one (e5m2, the fnuz formats, e8m0 / mxfp8 scales, fp4, raw bytes) in the header's words.
KV_DTYPES = {torch.bfloat16: cabi.C["KDTREE_KV_BF16"], torch.float8_e4m3fn: cabi.C["KDTREE_KV_FP8_E4M3"]}


def kv_dtype_problem(dtype: torch.dtype) -> str | None:
    """None for a KV cache dtype the contract takes, else one line saying why not (KDTREE_KV_DTYPE_RULE's words for a
    narrow float)."""
    if dtype in KV_DTYPES:
        return None
    if dtype.itemsize <= 1 or "float8" in str(dtype) or "float4" in str(dtype):
        return f"kv_cache: dtype {dtype} {cabi.C['KDTREE_KV_DTYPE_RULE']}"
    return f"kv_cache: dtype {dtype}, expected torch.bfloat16 or torch.float8_e4m3fn"


def kv_dtype_fields(kv_cache: torch.Tensor, kv_scale: float | None) -> dict:
    """The params fields of a cache's dtype and scale (kv_dtype, kv_scale; ABI 9). bf16 leaves both at 0, so a library
    from before ABI 9 still takes a bf16 call; e4m3 takes its scale, 1.0 where none is given."""
    code = KV_DTYPES[kv_cache.dtype]
    if code == cabi.C["KDTREE_KV_BF16"]:
        return {"kv_dtype": code, "kv_scale": 0.0}
    return {"kv_dtype": code, "kv_scale": 1.0 if kv_scale is None else float(kv_scale)}


def _check_kv_scale(kv_cache: torch.Tensor, kv_scale) -> None:
    if kv_scale is None:
        return
    if isinstance(kv_scale, bool) or not isinstance(kv_scale, (int, float)):
        raise AbiArgumentError(f"kv_scale: expected a float, got {type(kv_scale).__name__}")
    if kv_cache.dtype == torch.bfloat16:
        if kv_scale not in (0, 1):
            raise AbiArgumentError(f"kv_scale {kv_scale:g} with a bf16 cache: only an e4m3 cache is scaled")
    elif not (math.isfinite(kv_scale) and kv_scale > 0) or torch.tensor(kv_scale, dtype=torch.float32).item() == 0:
        raise AbiArgumentError(f"kv_scale {kv_scale:g} must be finite and > 0 (in float32) for an e4m3 cache")


def check_inputs(x: VerifyInputs, out: torch.Tensor, lse: torch.Tensor) -> tuple[int, int, int]:
    """Contract checks that need no GPU: dtypes, ranks, widths, batch consistency, contiguity, alignment,
    one device for all. Returns (total_q, heads, batch)."""
    dev = x.q.device if isinstance(x.q, torch.Tensor) else None
    _check("q", x.q, torch.bfloat16, 3, dev)
    if isinstance(x.kv_cache, torch.Tensor) and kv_dtype_problem(x.kv_cache.dtype):
        raise AbiArgumentError(kv_dtype_problem(x.kv_cache.dtype))
    _check("kv_cache", x.kv_cache, tuple(KV_DTYPES), 3, dev)
    _check_kv_scale(x.kv_cache, x.kv_scale)
    _check("page_table", x.page_table, torch.int32, 2, dev, 4)
    _check("prefix_lens", x.prefix_lens, torch.int32, 1, dev, 4)
    _check("q_indptr", x.q_indptr, torch.int32, 1, dev, 4)
    _check("tree_mask", x.tree_mask, (torch.int64, torch.uint64), 2, dev, 8)
    _check("out", out, torch.bfloat16, 3, dev)
    _check("lse", lse, torch.float32, 2, dev, 4)
    n_q, heads, width = x.q.shape
    batch = x.prefix_lens.shape[0]
    if width != QK_DIM:
        raise AbiArgumentError(f"q: rows are {width} wide, expected {QK_DIM} (512 latent + 64 RoPE)")
    if x.kv_cache.shape[2] != QK_DIM:
        raise AbiArgumentError(f"kv_cache: rows are {x.kv_cache.shape[2]} wide, expected {QK_DIM}")
    if x.q_indptr.shape[0] != batch + 1 or x.page_table.shape[0] != batch:
        raise AbiArgumentError(f"batch mismatch: prefix_lens {batch}, q_indptr {x.q_indptr.shape[0]} "
                               f"(want {batch + 1}), page_table {x.page_table.shape[0]}")
    page_problem = cabi.page_size_problem(x.kv_cache.shape[1])
    if page_problem:
        raise AbiArgumentError(f"kv_cache: {page_problem}")
    if x.tree_mask.shape[0] != n_q:
        raise AbiArgumentError(f"tree_mask: {x.tree_mask.shape[0]} rows, q has {n_q}")
    if tuple(out.shape) != (n_q, heads, LATENT_DIM):
        raise AbiArgumentError(f"out: shape {tuple(out.shape)}, expected {(n_q, heads, LATENT_DIM)}")
    if tuple(lse.shape) != (n_q, heads):
        raise AbiArgumentError(f"lse: shape {tuple(lse.shape)}, expected {(n_q, heads)}")
    return n_q, heads, batch


class Library:
    def __init__(self, path: str | Path | None = None):
        if path and not Path(path).exists():  # named wrongly: bad input (the default one missing: not built)
            raise BadInput(f"{path}: no such library")
        path = kbuild.library_file(Path(path)) if path else kbuild.latest_library()  # a build folder: its library
        if path is None:
            raise EnvironmentMissing(kbuild.missing_default_library())
        if not Path(path).is_file():
            raise EnvironmentMissing(f"kernel library not built ({path}): run 'kdev build'")
        self.path = Path(path)
        try:
            self.lib = L = cabi.load(self.path)
        except cabi.LoadError as e:
            raise EnvironmentMissing(str(e)) from None
        # a library built before an entry point existed still loads (an A/B base); calling it is refused in call()
        self.kernels = tuple(k for k, fn in VERIFY_KERNELS.items() if hasattr(L, fn))
        self.abi_version = L.kdtree_abi_version()
        # its own header's structs (cabi.load bound it with the header it was built from), filled by field name
        self.structs = L.kdev_contract.structs
        # ABI 7: run() fills shared memory with NaN before each launch (a library from older sources runs without it)
        self.poisons_shared_memory = hasattr(L, "kdtree_poison_shared_memory")
        self.plan_sm_count = 0  # plan_as(): every flash call planned as for a GPU of that many SMs
        self.build_info = cabi.build_info(L)
        self.stale = self.build_info.get("source_hash") != kbuild.source_hash()
        # an A/B library (kdev build --kernels) comes from another kernels/ tree by design: no warning for it
        if self.stale and not self.build_info.get("variant"):
            warnings.warn(f"{self.path} was built from sources {self.build_info.get('source_hash', '?')[:12]}, "
                          f"kernels/ is now {kbuild.source_hash()[:12]}: run 'kdev build'", StaleLibraryWarning,
                          stacklevel=2)

    def plan_as(self, sm_count: int) -> None:
        """Plan every flash call through this library as for a GPU of sm_count SMs (VerifyAttnParams.plan_sm_count):
        another GPU's split plan and workspace, run here. 0: this GPU's own."""
        if sm_count < 0:
            raise AbiArgumentError(f"plan_sm_count {sm_count} < 0")
        if sm_count and "plan_sm_count" not in dict(self.structs["VerifyAttnParams"]._fields_):
            raise EnvironmentMissing(f"{self.path}: its VerifyAttnParams has no plan_sm_count (its flash calls would "
                                     f"plan for this GPU regardless): rebuild with 'kdev build'")
        self.plan_sm_count = sm_count

    # ------------------------------------------------------------------------------------ small calls
    @property
    def max_qlen(self) -> int:
        return self.lib.kdtree_max_qlen()

    def last_error(self) -> str:
        return cabi.last_error(self.lib)

    def _status(self, fn: str, status: int) -> None:
        if status != 0:
            raise KernelError(fn, status, self.last_error())

    # ---------------------------------------------------------------------------------------- params
    def make(self, struct: str, **fields) -> cabi.Params:
        """One of this library's params structs, filled by field name (cabi.make)."""
        try:
            return cabi.make(self.structs[struct], **fields)
        except cabi.LoadError as e:
            raise EnvironmentMissing(f"{self.path}: {e}") from None

    def kv_fields(self, x: VerifyInputs) -> dict:
        """The cache's dtype and scale as this library's VerifyAttnParams takes them: where it has no kv_dtype (no verify
        kernel of it reads an e4m3 cache; kdtree.h), a bf16 call passes none and an e4m3 one is refused before any
        call."""
        fields = kv_dtype_fields(x.kv_cache, x.kv_scale)
        if "kv_dtype" in dict(self.structs["VerifyAttnParams"]._fields_):
            return fields
        if fields["kv_dtype"] != cabi.C["KDTREE_KV_BF16"]:
            raise AbiArgumentError(f"kv_cache: an e4m3 cache, which no verify kernel of {self.path.name} reads yet "
                                   f"(its VerifyAttnParams has no kv_dtype: kdtree.h)")
        return {}

    def params(self, x: VerifyInputs, out: torch.Tensor, lse: torch.Tensor,
               workspace: torch.Tensor | None = None) -> cabi.Params:
        """Check every tensor against the contract and fill the params struct."""
        if not isinstance(x.q, torch.Tensor) or x.q.device.type != "cuda":
            raise AbiArgumentError(f"q: must be a CUDA tensor (got {getattr(x.q, 'device', type(x.q))})")
        n_q, heads, batch = check_inputs(x, out, lse)
        dev = x.q.device
        max_qlen, max_kv_len = x.max_qlen, x.max_kv_len
        if max_qlen is None or max_kv_len is None:
            lens = (x.q_indptr[1:] - x.q_indptr[:-1]).cpu()
            max_qlen = max_qlen or int(lens.max())
            max_kv_len = max_kv_len or int((lens + x.prefix_lens.cpu()).max())
        p = self.make(
            "VerifyAttnParams", batch=batch, total_q=n_q, num_heads=heads,
            max_qlen=max_qlen, mask_words=x.tree_mask.shape[1], num_pages=x.kv_cache.shape[0],
            page_size=x.kv_cache.shape[1], max_pages=x.page_table.shape[1], max_kv_len=max_kv_len,
            scale=float(x.scale), plan_sm_count=self.plan_sm_count,
            q=x.q.data_ptr(), kv_cache=x.kv_cache.data_ptr(), page_table=x.page_table.data_ptr(),
            prefix_lens=x.prefix_lens.data_ptr(), q_indptr=x.q_indptr.data_ptr(), tree_mask=x.tree_mask.data_ptr(),
            out=out.data_ptr(), lse=lse.data_ptr(), workspace=None, workspace_bytes=0,
            **self.kv_fields(x))
        if workspace is not None:
            _check("workspace", workspace, workspace.dtype, 1, dev)
            p.workspace, p.workspace_bytes = workspace.data_ptr(), workspace.numel() * workspace.element_size()
        return p

    def plan_params(self, prefix_lens: torch.Tensor, q_indptr: torch.Tensor, heads: int, page_size: int,
                    max_qlen: int, max_kv_len: int) -> cabi.Params:
        """The params of a verify call as its plan and schedule read them (kdtree.h: the shapes, the page size, the
        lengths; no queries, pool or outputs): what an engine has at the start of a decoding step, before any layer."""
        dev = prefix_lens.device
        _check("prefix_lens", prefix_lens, torch.int32, 1, dev, 4)
        _check("q_indptr", q_indptr, torch.int32, 1, dev, 4)
        batch = prefix_lens.shape[0]
        if q_indptr.shape[0] != batch + 1:
            raise AbiArgumentError(f"q_indptr: {q_indptr.shape[0]} entries, expected batch + 1 = {batch + 1}")
        return self.make(
            "VerifyAttnParams", batch=batch, total_q=batch * max_qlen, num_heads=heads,
            max_qlen=max_qlen, mask_words=(max_qlen + 63) // 64, page_size=page_size, max_kv_len=max_kv_len,
            plan_sm_count=self.plan_sm_count, prefix_lens=prefix_lens.data_ptr(), q_indptr=q_indptr.data_ptr())

    def workspace_size(self, p: cabi.Params) -> int:
        n = ctypes.c_size_t(0)
        self._status("kdtree_verify_attn_workspace_size", self.lib.kdtree_verify_attn_workspace_size(ctypes.byref(p), ctypes.byref(n)))
        return n.value

    def flash_splits(self, p: cabi.Params) -> int:
        n = ctypes.c_int(0)
        self._status("kdtree_verify_attn_flash_splits", self.lib.kdtree_verify_attn_flash_splits(ctypes.byref(p), ctypes.byref(n)))
        return n.value

    # ----------------------------------------------------------------------------------------- calls
    def schedule(self, p: cabi.Params, stream: torch.cuda.Stream | None = None) -> None:
        """Make the device schedule for p's lengths in p's workspace (kdtree_flash_schedule). Asynchronous."""
        s = stream or torch.cuda.current_stream()
        self._status("kdtree_flash_schedule", self.lib.kdtree_flash_schedule(ctypes.byref(p),
                                                                             ctypes.c_void_p(s.cuda_stream)))

    def call(self, kernel: str, p: cabi.Params, stream: torch.cuda.Stream | None = None,
             schedule: bool = True) -> None:
        """Launch one verify kernel on `stream` (default: the current torch stream). Asynchronous. A scheduled kernel
        makes its schedule first unless `schedule` is false (the workspace already holds it for these lengths)."""
        if kernel not in VERIFY_KERNELS:
            raise AbiArgumentError(f"unknown verify kernel {kernel!r} (have {', '.join(VERIFY_KERNELS)})")
        if kernel not in self.kernels:
            raise AbiArgumentError(f"{self.path.name} has no {kernel} kernel ({VERIFY_KERNELS[kernel]}): built from "
                                   "older sources")
        fn = VERIFY_KERNELS[kernel]
        s = stream or torch.cuda.current_stream()
        if kernel in SCHEDULED_KERNELS and schedule:
            self.schedule(p, s)
        self._status(fn, getattr(self.lib, fn)(ctypes.byref(p), ctypes.c_void_p(s.cuda_stream)))

    def poison_shared_memory(self, stream=None) -> None:
        """Every SM's shared memory filled with NaN on the stream: a kernel launched after it that reads shared memory
        it never wrote gives NaN, not what the kernel before left there (often finite: a read that passes by luck)."""
        s = stream or torch.cuda.current_stream()
        status = self.lib.kdtree_poison_shared_memory(ctypes.c_void_p(s.cuda_stream))
        self._status("kdtree_poison_shared_memory", status)

    def alloc_outputs(self, x: VerifyInputs):
        """out and lse poisoned with NaN, so an unwritten element cannot pass."""
        n_q, heads, _ = x.q.shape
        out = torch.full((n_q, heads, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=x.q.device)
        lse = torch.full((n_q, heads), float("nan"), dtype=torch.float32, device=x.q.device)
        return out, lse

    def alloc_workspace(self, kernel: str, p: cabi.Params, device) -> torch.Tensor | None:
        if kernel not in SPLIT_KV_KERNELS:
            return None
        n = self.workspace_size(p)
        if n == 0:
            return None
        ws = torch.full(((n + 3) // 4,), float("nan"), dtype=torch.float32, device=device)
        p.workspace, p.workspace_bytes = ws.data_ptr(), ws.numel() * 4
        return ws

    def run(self, kernel: str, x: VerifyInputs, sync: bool = True):
        """Poisoned outputs, workspace and shared memory, launch on the current stream, (sync). Returns (out, lse)."""
        out, lse = self.alloc_outputs(x)
        p = self.params(x, out, lse)
        ws = self.alloc_workspace(kernel, p, x.q.device)
        if self.poisons_shared_memory:
            self.poison_shared_memory()
        self.call(kernel, p)
        if sync:
            torch.cuda.current_stream().synchronize()
        del ws
        return out, lse


def load_library(path: str | Path | None = None, log=None, build: bool = True) -> Library:
    """The library to run: `path`, else the last `kdev build` (of build.yaml's archs, else of the arch a build for this
    GPU targets (kbuild.build_arch_for: sm_90a on an sm_90 GPU), else of this GPU's arch alone) if it is current and has
    code for this GPU, else a build for that arch (a cache hit when nothing changed) where `build` allows it; without,
    one line saying what to build or name."""
    from kdev import gpu
    from kdev.errors import CheckFailed

    if path:
        return Library(path)
    here = gpu.current_arch()
    target = kbuild.build_arch_for(here)
    for latest in (kbuild.latest_library(), kbuild.latest_library(archs=[target]), kbuild.latest_library(archs=[here])):
        if latest is None:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StaleLibraryWarning)
            lib = Library(latest)
        if not lib.stale and kbuild.runs_on(lib.build_info.get("archs", []), here):
            return lib
    if not build:
        raise EnvironmentMissing(f"no current kdev library with code for {here}: run 'kdev build --arch {target}' "
                                 f"before the server starts, or name one with KDEV_LIB")
    res = kbuild.build(config.load_build(None, [target]), log=log)
    if res.problems:
        raise CheckFailed(f"kdev build failed its resource gate: {res.problems[0]}")
    return Library(res.library)


# ------------------------------------------------------------------------------ kernels of another build
def kernel_ref(name: str) -> tuple[str, str] | None:
    """KERNEL@REF: one of our verify kernels from another build, run beside this run's library's (kdev bench times
    both in one run, kdev verify compares them). REF is a library or its build folder, a copy of kernels/ (an A/B
    base or a variant), a git revision (flash@main: main's kernels/) or a patch (flash@variants/NAME.patch: this
    checkout's kernels/ with it applied); the last three are built for this GPU on first use. (kernel, REF), or None
    for a plain kernel name."""
    kernel, at, ref = name.partition("@")
    if not at:
        return None
    if kernel not in VERIFY_KERNELS or not ref:
        raise BadInput(f"{name!r}: KERNEL@REF takes one of {', '.join(VERIFY_KERNELS)} and a library, "
                       "build folder, copy of kernels/, git revision or kernels patch")
    if refs.describe_library_ref(ref) is None:
        raise BadInput(f"{name!r}: {ref}: {refs.NO_LIBRARY_REF}")
    return kernel, ref


def load_kernel_refs(names: list[str], plan_sms: int = 0, arch: str | None = None, log=None) -> dict:
    """{name: (Library, kernel)} for the KERNEL@REF names, each library loaded once (a kernels/ tree or a
    revision built first, for `arch`: this GPU's unless named, its arch-specific form for a wgmma kernel, whose code
    only an sm_90a build holds). A library without the kernel's entry point (built before it existed) is bad input,
    refused before anything runs; one that fails the resource gate is run with a warning, as the variants of a GPU
    round are."""
    libraries, others = {}, {}
    for name in names:
        parsed = kernel_ref(name)
        if parsed is None:
            continue
        kernel, ref = parsed
        if refs.describe_library_ref(ref) == "library":
            path = kbuild.library_file(Path(ref))
        else:
            build_arch = arch
            if build_arch is None:
                from kdev import gpu

                build_arch = kbuild.build_arch_for(gpu.current_arch())  # built as this checkout's library is
                if kernel in WGMMA_KERNELS and kbuild.runs_on([config.WGMMA_ARCH], build_arch):
                    build_arch = config.WGMMA_ARCH
            res = refs.library_for(ref, [build_arch], log)
            if res.problems and log:
                log(f"{name}: its build fails the resource gate ({res.problems[0]}); run anyway")
            path = res.library
        key = str(Path(path).resolve())
        if key not in libraries:
            libraries[key] = Library(path)
            if plan_sms:
                libraries[key].plan_as(plan_sms)
        lib = libraries[key]
        if kernel not in lib.kernels:
            raise BadInput(f"{name!r}: {lib.path} has no {kernel} entry point (built before it existed)")
        others[name] = (lib, kernel)
    return others


# ------------------------------------------------------------------------------------------ DDTree kernels
def _i32(name: str, t: torch.Tensor, shape: tuple, device) -> None:
    _check(name, t, torch.int32, len(shape), device, 4)
    if tuple(t.shape) != shape:
        raise AbiArgumentError(f"{name}: shape {tuple(t.shape)}, expected {shape}")


class TreeKernels:
    """The DDTree build, greedy accept and KV compaction entry points of a loaded Library. prepare_* checks
    the tensors and allocates (poisoned) outputs once; launch() runs a prepared call on the current stream
    (no allocation: what a benchmark times); build_ddtree / accept_greedy / compact_kv do both."""

    FUNCTIONS = {"build": "kdtree_build_ddtree", "accept": "kdtree_accept_greedy", "compact": "kdtree_compact_kv"}

    def __init__(self, lib: Library):
        self.lib = lib

    def launch(self, which: str, p) -> None:
        fn = self.FUNCTIONS[which]
        s = torch.cuda.current_stream()
        self.lib._status(fn, getattr(self.lib.lib, fn)(ctypes.byref(p), ctypes.c_void_p(s.cuda_stream)))

    def prepare_build(self, log_probs: torch.Tensor, token_ids: torch.Tensor, root_tokens: torch.Tensor,
                      prefix_lens: torch.Tensor, budget: int):
        """Padded outputs [B, 1 + budget] (node_tokens, parents, depths, positions), tree_mask
        [B, 1 + budget, W] (int64 bits) and node_count [B], poisoned; returns (params, outputs)."""
        dev = log_probs.device
        _check("log_probs", log_probs, torch.float32, 3, dev, 4)
        B, D, K = log_probs.shape
        _i32("token_ids", token_ids, (B, D, K), dev)
        _i32("root_tokens", root_tokens, (B,), dev)
        _i32("prefix_lens", prefix_lens, (B,), dev)
        t = 1 + budget
        W = (t + 63) // 64
        out = {k: torch.full((B, t), -7777, dtype=torch.int32, device=dev)
               for k in ("node_tokens", "parents", "depths", "positions")}
        out["tree_mask"] = torch.full((B, t, W), -1, dtype=torch.int64, device=dev)
        out["node_count"] = torch.full((B,), -7777, dtype=torch.int32, device=dev)
        p = self.lib.make("DDTreeBuildParams", batch=B, depth=D, topk=K, budget=budget, mask_words=W,
                          log_probs=log_probs.data_ptr(), token_ids=token_ids.data_ptr(),
                          root_tokens=root_tokens.data_ptr(), prefix_lens=prefix_lens.data_ptr(),
                          **{k: out[k].data_ptr() for k in ("node_tokens", "parents", "depths", "positions",
                                                            "tree_mask", "node_count")})
        return p, out

    def build_ddtree(self, *args, **kwargs) -> dict:
        p, out = self.prepare_build(*args, **kwargs)
        self.launch("build", p)
        return out

    def prepare_accept(self, node_tokens, parents, node_count, target_argmax):
        """Padded [B, T] inputs; returns (params, (accepted [B, T] with -1 after the end, accept_len [B],
        bonus [B]))."""
        dev = node_tokens.device
        B, T = node_tokens.shape
        for name, t in (("node_tokens", node_tokens), ("parents", parents), ("target_argmax", target_argmax)):
            _i32(name, t, (B, T), dev)
        _i32("node_count", node_count, (B,), dev)
        accepted = torch.full((B, T), -7777, dtype=torch.int32, device=dev)
        length = torch.full((B,), -7777, dtype=torch.int32, device=dev)
        bonus = torch.full((B,), -7777, dtype=torch.int32, device=dev)
        p = self.lib.make("AcceptParams", batch=B, t_stride=T, node_tokens=node_tokens.data_ptr(),
                          parents=parents.data_ptr(), node_count=node_count.data_ptr(),
                          target_argmax=target_argmax.data_ptr(), accepted=accepted.data_ptr(),
                          accept_len=length.data_ptr(), bonus_token=bonus.data_ptr())
        return p, (accepted, length, bonus)

    def accept_greedy(self, *args):
        p, out = self.prepare_accept(*args)
        self.launch("accept", p)
        return out

    def prepare_compact(self, kv_cache, page_table, prefix_lens, accepted, accept_len) -> cabi.Params:
        """In place when launched: accepted node i's KV row moves to slot prefix_len + i."""
        dev = kv_cache.device
        if isinstance(kv_cache, torch.Tensor) and kv_dtype_problem(kv_cache.dtype):
            raise AbiArgumentError(kv_dtype_problem(kv_cache.dtype))
        _check("kv_cache", kv_cache, tuple(KV_DTYPES), 3, dev)
        B, T = accepted.shape
        _i32("accepted", accepted, (B, T), dev)
        _i32("accept_len", accept_len, (B,), dev)
        _i32("prefix_lens", prefix_lens, (B,), dev)
        _check("page_table", page_table, torch.int32, 2, dev, 4)
        return self.lib.make("CompactParams", batch=B, t_stride=T, page_size=kv_cache.shape[1],
                             max_pages=page_table.shape[1], num_pages=kv_cache.shape[0], kv_cache=kv_cache.data_ptr(),
                             page_table=page_table.data_ptr(), prefix_lens=prefix_lens.data_ptr(),
                             accepted=accepted.data_ptr(), accept_len=accept_len.data_ptr(),
                             kv_dtype=KV_DTYPES[kv_cache.dtype])

    def compact_kv(self, *args) -> None:
        self.launch("compact", self.prepare_compact(*args))
