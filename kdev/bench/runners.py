"""The backends: the inputs of a shape, and a runner per backend, registered by name (RUNNERS); a new peer is a
Runner subclass and one register() line, or any function through --peer module:function."""

from __future__ import annotations

import importlib

import numpy as np

from kdev import registry
from kdev.bench.sweeps import Shape
from kdev.config import LATENT_DIM, QK_DIM
from kdev.errors import BadInput


# ---------------------------------------------------------------------------------------------- inputs
def make_inputs(shape: Shape, seed: int, device):
    """Random q and paged KV on the GPU (shuffled pages), DDTree / chain / star / random trees from the
    reference. Returns (VerifyInputs, tree sizes, prefix lens)."""
    import torch

    from kdev import abi, cases, ddtree
    from kdev.config import CaseSpec, TreeSpec, load_model

    rng = np.random.default_rng(seed)

    def tree_spec(budget: int) -> TreeSpec:
        if shape.tree == "ddtree":
            return TreeSpec("ddtree", budget=budget, depth=15, topk=budget, vocab=32000)
        return TreeSpec(shape.tree, nodes=budget + 1)

    trees = []
    for L, budget in zip(shape.prefix_lens, shape.budget_list):  # a skewed batch: each request its own tree size
        one = CaseSpec("bench", (L,), tree_spec(budget), shape.heads, shape.page_size, seed, "kimi-k2.6", None)
        trees += cases.make_trees(one, rng)[0]
    spec = CaseSpec("bench", shape.prefix_lens, tree_spec(shape.budget), shape.heads, shape.page_size, seed,
                    "kimi-k2.6", None)
    sizes = [t.size for t in trees]
    g = torch.Generator(device=device).manual_seed(seed)
    n_q = sum(sizes)
    q = torch.randn(n_q, shape.heads, QK_DIM, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    pages = [-(-(L + t) // shape.page_size) for L, t in zip(spec.prefix_lens, sizes)]
    # a replay at a capture's bounds: the page table and the pool as wide as those bounds need (the call's contract)
    bound_pages = -(-shape.bounds[0] // shape.page_size) if shape.bounds else 0
    num_pages = max(sum(pages), bound_pages)
    kv = torch.randn(num_pages, shape.page_size, QK_DIM, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    perm = torch.randperm(num_pages, generator=g, device=device).to(torch.int32)
    page_table = torch.zeros(shape.batch, max(*pages, bound_pages), dtype=torch.int32, device=device)
    off = 0
    for b, n in enumerate(pages):
        page_table[b, :n] = perm[off:off + n]
        off += n
    mask = torch.from_numpy(ddtree.batch_tree_mask(trees).view(np.int64)).to(device)
    if shape.bounds and mask.shape[1] < -(-shape.bounds[1] // 64):  # mask rows as wide as the capture's largest tree
        mask = torch.nn.functional.pad(mask, (0, -(-shape.bounds[1] // 64) - mask.shape[1]))
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int32, device=device)
    # the bounds the call is planned for: the batch's own, or those of the larger batch a graph was captured for
    max_kv_len, max_qlen = shape.bounds or (max(L + t for L, t in zip(spec.prefix_lens, sizes)), max(sizes))
    x = abi.VerifyInputs(q, kv, page_table, torch.tensor(spec.prefix_lens, dtype=torch.int32, device=device), indptr,
                         mask, load_model("kimi-k2.6").softmax_scale, max_qlen=max_qlen, max_kv_len=max_kv_len)
    return x, sizes, list(spec.prefix_lens)


# -------------------------------------------------------------------------------------------- backends
class Runner:
    """Constructed = prepared; run() launches once on the current stream; out/lse hold the last outputs;
    poison() fills them with NaN (before every timed sample, outside the timed region)."""

    out = None
    lse = None

    def run(self) -> None:
        raise NotImplementedError

    def poison(self) -> None:
        for t in (self.out, self.lse):
            if t is not None:
                t.fill_(float("nan"))


class AbiRunner(Runner):
    def __init__(self, lib, kernel: str, x):
        self.lib, self.kernel = lib, kernel
        self.out, self.lse = lib.alloc_outputs(x)
        self.p = lib.params(x, self.out, self.lse)
        self.ws = lib.alloc_workspace(kernel, self.p, x.q.device)
        from kdev.abi import SPLIT_KV_KERNELS

        self.splits = lib.flash_splits(self.p) if kernel in SPLIT_KV_KERNELS else None

    def run(self) -> None:
        self.lib.call(self.kernel, self.p)


class LayerRunner(AbiRunner):
    """A scheduled call as each layer of a decoding step makes it: the schedule made once, before any timed call (the
    lengths do not change between samples), each timed call the scheduled verify call alone."""

    def __init__(self, lib, kernel: str, x):
        super().__init__(lib, kernel, x)
        lib.schedule(self.p)

    def run(self) -> None:
        self.lib.call(self.kernel, self.p, schedule=False)


# the per-layer backends: the scheduled call each times without its schedule (made once per step, for every layer)
LAYER_BACKENDS = registry.LAYER_BACKENDS


def _gathered(x):
    """Per request: contiguous K [S, 576] and the bool mask [T, S] (prefix all True, tree from the bits)."""
    import torch

    from kdev import mla

    out = []
    ind = x.q_indptr.tolist()
    for b, L in enumerate(x.prefix_lens.tolist()):
        T = ind[b + 1] - ind[b]
        k = mla.gather_kv(x.kv_cache, x.page_table[b], L + T).contiguous()
        m = torch.ones(T, L + T, dtype=torch.bool, device=k.device)
        m[:, L:] = mla.unpack_tree_mask(x.tree_mask, slice(ind[b], ind[b + 1]), T)
        out.append((ind[b], ind[b + 1], k, m))
    return out


class TorchEagerRunner(Runner):
    """float32 einsum + masked softmax + einsum, one request at a time."""

    def __init__(self, x):
        import torch

        self.x, self.parts = x, _gathered(x)
        self.out = torch.empty(x.q.shape[0], x.q.shape[1], LATENT_DIM, dtype=torch.float32, device=x.q.device)
        self.lse = torch.empty(x.q.shape[0], x.q.shape[1], dtype=torch.float32, device=x.q.device)

    def run(self) -> None:
        import torch

        for r0, r1, k, m in self.parts:
            kf = k.float()
            s = torch.einsum("thd,sd->ths", self.x.q[r0:r1].float(), kf) * self.x.scale
            s = s.masked_fill(~m[:, None, :], float("-inf"))
            self.lse[r0:r1] = torch.logsumexp(s, -1)
            self.out[r0:r1] = torch.einsum("ths,sc->thc", torch.softmax(s, -1), kf[:, :LATENT_DIM])


class TorchSdpaRunner(Runner):
    """scaled_dot_product_attention with a boolean mask; K/V expanded over heads (no copy)."""

    def __init__(self, x):
        import torch

        self.x, self.parts = x, _gathered(x)
        self.out = torch.empty(x.q.shape[0], x.q.shape[1], LATENT_DIM, dtype=torch.bfloat16, device=x.q.device)

    def run(self) -> None:
        import torch.nn.functional as F

        H = self.x.q.shape[1]
        for r0, r1, k, m in self.parts:
            q = self.x.q[r0:r1].permute(1, 0, 2).unsqueeze(0)  # [1, H, T, 576]
            kk = k[None, None].expand(1, H, -1, -1)
            vv = k[None, None, :, :LATENT_DIM].expand(1, H, -1, -1)
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=m[None, None], scale=self.x.scale)
            self.out[r0:r1] = o[0].permute(1, 0, 2)


class TorchFlexRunner(Runner):
    """torch FlexAttention, as a Hopper user would write this call with it: every request's KV gathered from its pages
    into one sequence and its queries into another (at construction, as the other torch peers gather), and a block
    mask that lets a query row see its own request's prefix and its tree ancestors (document masking); one latent KV
    head shared by the query heads (enable_gqa). Compiled on a GPU (torch.compile: the fused kernel), eager on the CPU.
    The compiled kernel's own tile choice at 576-wide rows asks for more shared memory than a Hopper SM has (428 KB on
    an H100): when the first call fails, it is compiled again with each tile of SMALL_TILES in turn, as a user would
    pass them, and the one that compiles is recorded as `tiles`; if none does, the run reports the last error."""

    # (BLOCK_M, BLOCK_N, stages): Q 32 x 576, K 32 x 576 and V 32 x 512 bf16 in one stage are ~104 KB
    SMALL_TILES = ((64, 32, 1), (32, 32, 1), (32, 16, 1), (16, 16, 1))

    def __init__(self, x):
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        dev = x.q.device
        parts = _gathered(x)
        H = x.q.shape[1]
        k = torch.cat([kk for _, _, kk, _ in parts])  # [S, 576]
        kv_doc = torch.cat([torch.full((kk.shape[0],), b, dtype=torch.int32, device=dev)
                            for b, (_, _, kk, _) in enumerate(parts)])
        q_doc = torch.cat([torch.full((r1 - r0,), b, dtype=torch.int32, device=dev)
                           for b, (r0, r1, _, _) in enumerate(parts)])
        # query row i of request b sees key j of request b where its mask row says so: one [rows, longest] table
        width = max(kk.shape[0] for _, _, kk, _ in parts)
        seen = torch.zeros(x.q.shape[0], width, dtype=torch.bool, device=dev)
        for r0, r1, kk, m in parts:
            seen[r0:r1, :kk.shape[0]] = m
        start = torch.zeros(len(parts), dtype=torch.int64, device=dev)
        start[1:] = torch.cumsum(torch.tensor([kk.shape[0] for _, _, kk, _ in parts[:-1]], device=dev), 0)

        def mask_mod(b, h, qi, kj):
            return (q_doc[qi] == kv_doc[kj]) & seen[qi, (kj - start[kv_doc[kj]]).clamp(0, width - 1)]

        n, S = x.q.shape[0], k.shape[0]
        self.block_mask = create_block_mask(mask_mod, 1, None, n, S, device=str(dev))
        self.q = x.q.permute(1, 0, 2).unsqueeze(0).contiguous()  # [1, H, rows, 576]
        self.k = k[None, None].contiguous()                        # [1, 1, S, 576]: one KV head
        self.v = k[None, None, :, :LATENT_DIM].contiguous()
        self.scale, self.heads = float(x.scale), H
        self.fn = torch.compile(flex_attention, dynamic=False) if dev.type == "cuda" else flex_attention
        try:
            from torch.nn.attention.flex_attention import AuxRequest

            self.aux = AuxRequest(lse=True)
        except ImportError:
            self.aux = None
        self.out = torch.empty(n, H, LATENT_DIM, dtype=x.q.dtype, device=dev)
        self.lse = torch.empty(n, H, dtype=torch.float32, device=dev)
        self.kernel_options, self.tiles, self.compiled = None, None, dev.type != "cuda"

    def _call(self):
        extra = {"kernel_options": self.kernel_options} if self.kernel_options else {}
        if self.aux is not None:
            o, aux = self.fn(self.q, self.k, self.v, block_mask=self.block_mask, scale=self.scale, enable_gqa=True,
                             return_aux=self.aux, **extra)
            return o, aux.lse
        # a torch from before return_aux
        return self.fn(self.q, self.k, self.v, block_mask=self.block_mask, scale=self.scale, enable_gqa=True,
                       return_lse=True, **extra)

    def _first_call(self):
        import torch

        try:
            return self._call()
        except Exception as first:  # noqa: BLE001 - the compiler's errors have no common base
            error = first
        for bm, bn, stages in self.SMALL_TILES:
            torch._dynamo.reset()  # a failed compile is cached per call site: start clean
            self.kernel_options = {"BLOCK_M": bm, "BLOCK_N": bn, "num_stages": stages}
            try:
                res = self._call()
            except Exception as e:  # noqa: BLE001
                error = e
                continue
            self.tiles = f"{bm}x{bn}x{stages}"
            return res
        raise error

    def run(self) -> None:
        if not self.compiled:
            o, lse = self._first_call()
            self.compiled = True
        else:
            o, lse = self._call()
        self.out.copy_(o[0].permute(1, 0, 2))
        self.lse.copy_(lse[0].permute(1, 0))


class TritonRunner(Runner):
    """kdev/triton_peer.py: the contract as a Triton kernel (heads x nodes packed, split-KV, a Triton combine)
    reading the paged cache itself; construction times its tile sizes at this shape and keeps the fastest
    (recorded as `tiles`)."""

    def __init__(self, x):
        import torch

        from kdev import triton_peer

        sms = torch.cuda.get_device_properties(x.q.device).multi_processor_count
        self.impl = triton_peer.TritonTreeVerify(x, sms)  # compiles, tunes, and leaves the chosen tile's output
        self.out, self.lse, self.splits = self.impl.out, self.impl.lse, self.impl.splits
        self.tiles, self.tiles_tuned = str(self.impl.config), self.impl.tuned or None

    def run(self) -> None:
        self.impl()


class PeerRunner(Runner):
    def __init__(self, fn, x):
        self.fn, self.x = fn, x

    def run(self) -> None:
        x = self.x
        res = self.fn(x.q, x.kv_cache, x.page_table, x.prefix_lens, x.q_indptr, x.tree_mask, x.scale)
        self.out, self.lse = (res if isinstance(res, tuple) else (res, None))


def load_peer(spec: str):
    if ":" not in spec:
        raise BadInput(f"--peer {spec!r}: expected module:function")
    mod, fn = spec.split(":", 1)
    try:
        f = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise BadInput(f"--peer {spec}: cannot load: {e}") from None
    if not callable(f):
        raise BadInput(f"--peer {spec}: not callable")
    return f


# The peers by name: a backend that needs only the inputs (the verify kernels need a library, --peer a function). A new
# peer is a Runner subclass and one line here.
RUNNERS: dict[str, type[Runner]] = {"torch-eager": TorchEagerRunner, "torch-sdpa": TorchSdpaRunner,
                                    "torch-flex": TorchFlexRunner, "triton": TritonRunner}


def make_runner(name: str, x, lib, peers: dict, others: dict | None = None) -> Runner:
    from kdev.abi import VERIFY_KERNELS

    if name in VERIFY_KERNELS:
        return AbiRunner(lib, name, x)
    if name in LAYER_BACKENDS:
        return LayerRunner(lib, LAYER_BACKENDS[name], x)
    if others and name in others:  # KERNEL@REF
        other_lib, kernel = others[name]
        return AbiRunner(other_lib, kernel, x)
    if name in RUNNERS:
        return RUNNERS[name](x)
    if name in peers:
        return PeerRunner(peers[name], x)
    raise BadInput(f"unknown backend {name!r}")
