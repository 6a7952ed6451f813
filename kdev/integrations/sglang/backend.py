"""kdev's verify kernel in SGLang's MLA target-verify forward; every other forward goes to the server's own backend.

Written against SGLang 0.5.23 (the release kdev.integrations.sglang.SGLANG_RELEASE names, which the tests in
tests/sglang_real/ check against the real modules). SGLang's attention backends are objects with a fixed set of hooks
(srt/layers/attention/base_attn_backend.py's AttentionBackend) made by a factory registered under a name
(attention_registry.py's `register_attention_backend`). `KdevVerifyBackend` wraps the backend the server would
otherwise use (the fallback) and takes over one thing: `forward_extend` in TARGET_VERIFY mode, where it writes the
draft nodes' latent rows into the MLA pool and calls torch.ops.kdev.verify_attn on the whole tree. Every other hook and
mode (prefill, decode, draft extend, idle) is the fallback's, and so is the state SGLang reads off a backend
(`forward_metadata`, `kv_index_translator`, `needs_cpu_seq_lens`, `verify_mask`, ...): `_sglang_class` forwards each of
the base class's attributes explicitly, since a base-class default would otherwise shadow the fallback's value.

The metadata hooks, as 0.5.23 calls them:
- eager: `init_forward_metadata(forward_batch)` (model_runner's forward) -> the fallback's, then kdev's inputs gathered
  into new tensors;
- CUDA graphs: `init_cuda_graph_state(max_bs, max_num_tokens)` once; `init_forward_metadata_out_graph(forward_batch,
  in_capture=True)` before each capture and `init_forward_metadata_out_graph(view)` before every replay
  (decode_cuda_graph_runner.py), both outside the graph: kdev gathers the verify inputs into static buffers there, by
  device operations alone, and the graph's kernel calls read those buffers; `init_forward_metadata_in_graph` is the
  fallback's alone. The flash plan under graphs is made for the model's context length (a bound: a scheduled call
  splits each request by its own length on the GPU at every replay), so one graph serves every length up to it.
- `update_verify_buffers_to_fill_after_draft(spec_info, bs)` (eagle_worker_common.py, with the overlap plan stream):
  the tree mask is gathered again from the mask the draft has now filled.

The node count T is the batch's (`spec_info.draft_token_num`): adaptive speculation changes it between batches. A
TARGET_VERIFY batch without a custom mask (DFLASH's causal block, dflash_worker_v2.py) is served as a chain.

Shadow mode (KDEV_SGLANG_SHADOW=1): every TARGET_VERIFY layer also runs the fallback's forward on the same inputs and
records the largest |kdev - fallback| per layer (`stats.shadow_max_diff`), logging a warning where it passes
KDEV_SGLANG_SHADOW_TOL; `stats.verify_layer_calls` counts the layer calls kdev served. For proving a deploy, not for
serving (each verify layer runs twice).

This module imports without SGLang; only `register()`, `create()` and `_sglang_class()` import SGLang's modules.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field

import torch

from kdev import abi, cabi
from kdev.integrations.sglang import convert

log = logging.getLogger("kdev.sglang")

BACKEND_NAME = "kdev"
# the Hopper product's call on the device schedule: each request split by its own length (a plan for the longest
# request, the host-planned call, costs 11.9x its parts on a skewed batch)
DEFAULT_KERNEL = abi.SCHEDULED_KERNELS[0]
# Where SGLang's registry, base class and the rest live in 0.5.23
_REGISTRY_MODULE = "sglang.srt.layers.attention.attention_registry"
_BASE_MODULE = "sglang.srt.layers.attention.base_attn_backend"
_SERVER_ARGS_MODULE = "sglang.srt.server_args"
_POOL_MODULE = "sglang.srt.mem_cache.memory_pool"
_DEEPSEEK_DISPATCH_MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"
_DEEPSEEK_METHODS_MODULE = "sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods"
_RUNTIME_MODULE = "sglang.srt.runtime_context"
_SPEC_MASK_MODULE = "sglang.srt.speculative.eagle_utils"
# base-class attributes the wrapper answers itself (the rest are the fallback's): the names ModelRunner stamps on the
# backend it made, the ragged verify graph (kdev's gather takes one T per batch), and the verify mask (only a
# FULL_MASK one is forwarded: that is the layout kdev gathers from)
_OWN_STATE = ("prefill_attention_backend_str", "decode_attention_backend_str", "supports_ragged_verify_graph",
              "verify_mask")


@dataclass
class VerifyBatch:
    """kdev's verify inputs for one batch of trees, beside the batch's q and the pool: the contract's page_table,
    prefix_lens, q_indptr and tree_mask, and the host bounds the flash plan is made for."""

    page_table: torch.Tensor  # [B, max_pages] int32
    prefix_lens: torch.Tensor  # [B] int32
    q_indptr: torch.Tensor  # [B + 1] int32
    tree_mask: torch.Tensor  # [B * T, words] int64
    max_qlen: int
    max_kv_len: int


@dataclass
class VerifyStats:
    """What the backend did, for a deploy to read (`backend.stats`)."""

    verify_steps: int = 0  # TARGET_VERIFY batches whose inputs kdev gathered (eager steps and graph replays)
    verify_layer_calls: int = 0  # layer calls that ran kdev's kernel (eager, and each layer's call at capture)
    shadow_layer_checks: int = 0  # layer outputs compared with the fallback's (shadow mode, eager)
    shadow_flags: int = 0  # of which past the tolerance
    shadow_max_diff: dict = field(default_factory=dict)  # layer id -> the largest |kdev - fallback| seen


def verify_batch(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                 custom_mask: torch.Tensor | None, num_draft: int, page_size: int, max_kv_len: int,
                 into: VerifyBatch | None = None) -> VerifyBatch:
    """SGLang's target-verify batch -> kdev's inputs, by device operations alone (graph-capturable).

    seq_lens are the prefix lengths (the draft nodes come after them); request b's nodes are rows b*T .. b*T + T - 1 of
    q, their KV in req_to_token[req_pool_indices[b], L_b .. L_b + T - 1] (SGLang assigns them there before the verify
    forward); custom_mask is SGLang's FULL_MASK (request after request, T x (L_b + T) entries), or None for a chain
    (node i sees nodes 0..i: DFLASH's causal block). The tree part of each row is gathered from the mask; the prefix
    part is not read (kdev's nodes see the whole prefix). Pages: entry p of request b is the page holding its position
    p * page_size. With `into` (static buffers of at least this size), the results are written into them and views of
    them returned."""
    bs, T = req_pool_indices.shape[0], num_draft
    dev = req_to_token.device
    words = into.tree_mask.shape[1] if into is not None else (T + 63) // 64
    i = torch.arange(T, device=dev)
    if custom_mask is None:
        chain = (i[None, :] <= i[:, None]).repeat(bs, 1)
        tree_mask = convert.pack_rows(chain, words)
    else:
        lens = seq_lens.to(torch.int64)
        row_len = lens + T
        starts = torch.cumsum(T * row_len, 0) - T * row_len  # SGLang's mask_indptr[:-1]
        idx = starts[:, None, None] + i[None, :, None] * row_len[:, None, None] + lens[:, None, None] + i[None, None, :]
        # a padded request of a replayed graph may point past the mask: clamp (its rows are discarded)
        idx = idx.clamp_(0, max(custom_mask.numel() - 1, 0)).view(bs * T, T)
        tree_mask = convert.pack_rows(custom_mask.view(-1)[idx].bool(), words)
    # pages of the bound; the table's width ends where req_to_token's does (entries past it stay 0: never read)
    pages = (max_kv_len + page_size - 1) // page_size
    rows = req_to_token.index_select(0, req_pool_indices.to(torch.int64))
    slots = rows[:, : pages * page_size: page_size]
    prefix_lens = seq_lens.to(torch.int32)
    q_indptr = torch.arange(0, (bs + 1) * T, T, dtype=torch.int32, device=dev)
    if into is None:
        page_table = torch.zeros(bs, pages, dtype=torch.int32, device=dev)
        page_table[:, : slots.shape[1]] = (slots // page_size).to(torch.int32)
        return VerifyBatch(page_table, prefix_lens, q_indptr, tree_mask, T, max_kv_len)
    out = VerifyBatch(into.page_table[:bs], into.prefix_lens[:bs], into.q_indptr[: bs + 1], into.tree_mask[: bs * T],
                      T, max_kv_len)
    out.page_table.zero_()
    out.page_table[:, : slots.shape[1]] = (slots // page_size).to(torch.int32)
    out.prefix_lens.copy_(prefix_lens)
    out.q_indptr.copy_(q_indptr)
    out.tree_mask.copy_(tree_mask)
    return out


def check_verify_batch(batch: VerifyBatch, custom_mask: torch.Tensor | None, req_to_token: torch.Tensor,
                       req_pool_indices: torch.Tensor, positions: torch.Tensor | None, page_size: int) -> None:
    """What verify_batch takes on trust, checked with host reads (kdev's eager conversions, `convert`): the tree part
    of the mask is a tree, the slots form whole pages, positions are prefix + depth. The prefix columns are not checked:
    kdev never reads them, and SGLang leaves them unfilled where its backend does not read them either
    (fill_prefix_mask=False). ConversionError names the first request, node or position that is not so. For debugging a
    deploy (KDEV_SGLANG_CHECK=1), not for serving."""
    T = batch.max_qlen
    row_len = batch.prefix_lens.to(torch.int64) + T
    if custom_mask is not None:
        mask_indptr = torch.cat([row_len.new_zeros(1), torch.cumsum(T * row_len, 0)])
        tree = convert.custom_mask_to_tree_mask(custom_mask, mask_indptr, batch.prefix_lens, batch.q_indptr,
                                                batch.tree_mask.shape[1], check_prefix=False)
        if not torch.equal(tree, batch.tree_mask):
            raise convert.ConversionError("the gathered tree mask differs from the checked conversion")
    convert.token_slots_to_page_table(req_to_token, req_pool_indices, row_len, page_size)
    if positions is not None:
        convert.check_positions(positions, batch.prefix_lens, batch.q_indptr, batch.tree_mask)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def num_draft_of(spec_info) -> int:
    """The batch's nodes per request: `draft_token_num` (EAGLE's and DFLASH's verify inputs), else
    `num_tokens_per_req`."""
    for name in ("draft_token_num", "num_tokens_per_req"):
        T = getattr(spec_info, name, None)
        if isinstance(T, int) and T > 0:
            return T
    raise convert.ConversionError(f"a TARGET_VERIFY batch whose spec_info ({type(spec_info).__name__}) carries no "
                                  "draft_token_num")


class KdevVerifyBackend:
    """The fallback backend with TARGET_VERIFY's forward_extend replaced by kdev's verify kernel (module docstring).

    fallback: the backend object the server would use (any attribute not defined here is the fallback's);
    req_to_token: SGLang's req_to_token table; page_size: the pool's tokens per page (kdev's page rule);
    max_context_len: the longest request the server takes (the bound of the plan under graphs);
    max_draft: the most nodes a batch's tree has (sizes the graph buffers; each batch's own T is its spec_info's);
    kernel: kdev's verify call (a name of kdev.abi.VERIFY_KERNELS; default DEFAULT_KERNEL, on the device schedule);
    kv_pool: SGLang's MLA token pool (default: the fallback's token_to_kv_pool), bf16 only;
    check: KDEV_SGLANG_CHECK; shadow: KDEV_SGLANG_SHADOW (module docstring); shadow_tol: KDEV_SGLANG_SHADOW_TOL.
    """

    supports_ragged_verify_graph = False  # the graph's gather takes one T per batch

    def __init__(self, fallback, req_to_token: torch.Tensor, page_size: int, max_context_len: int,
                 max_draft: int = cabi.MAX_QLEN, kernel: str | None = None, check: bool | None = None,
                 shadow: bool | None = None, shadow_tol: float | None = None, kv_pool=None):
        problem = cabi.page_size_problem(page_size)
        if problem:
            raise convert.ConversionError(problem)
        if not 1 <= max_draft <= cabi.MAX_QLEN:
            raise convert.ConversionError(f"{max_draft} draft tokens per request: kdev takes 1 to {cabi.MAX_QLEN}")
        kernel = kernel or DEFAULT_KERNEL
        if kernel not in abi.VERIFY_KERNELS:
            raise convert.ConversionError(f"verify kernel {kernel!r}: one of {', '.join(abi.VERIFY_KERNELS)}")
        self.fallback, self.req_to_token, self.page_size = fallback, req_to_token, page_size
        self.max_context_len, self.max_draft, self.kernel = max_context_len, max_draft, kernel
        self.kv_pool = kv_pool
        pool = self._pool()
        dtype = getattr(pool, "dtype", torch.bfloat16) if pool is not None else torch.bfloat16
        if dtype != torch.bfloat16:
            raise convert.ConversionError(f"kdev's verify kernel reads a bf16 MLA pool; this pool is {dtype} (an fp8 "
                                          "KV cache, --kv-cache-dtype): serve with a bf16 KV cache or another backend")
        self.check = _env_flag("KDEV_SGLANG_CHECK") if check is None else check
        self.shadow = _env_flag("KDEV_SGLANG_SHADOW") if shadow is None else shadow
        self.shadow_tol = float(os.environ.get("KDEV_SGLANG_SHADOW_TOL", "0.05")) if shadow_tol is None else shadow_tol
        self.graph_buffers: VerifyBatch | None = None
        self.batch: VerifyBatch | None = None  # this forward's verify inputs (TARGET_VERIFY only)
        self._gathered_from = None  # (req_pool_indices, seq_lens, T, bound, into) of the last gather
        self.step_schedule = None  # a scheduled kernel's, once per forward (kdev.ops.StepSchedule; made on first use)
        self.stats = VerifyStats()

    def __getattr__(self, name):  # only for what neither this class nor the base defines: the fallback's hooks/state
        if name == "fallback":
            raise AttributeError(name)
        return getattr(self.fallback, name)

    def _pool(self):
        if self.kv_pool is not None:
            return self.kv_pool
        return getattr(self.fallback, "token_to_kv_pool", None)

    @property
    def verify_mask(self):
        """The fallback's preallocated verify mask, when it is FULL_MASK (the layout kdev gathers from); else None, and
        SGLang builds a FULL_MASK one per step."""
        mask = getattr(self.fallback, "verify_mask", None)
        return mask if mask is not None and getattr(mask.mode, "name", None) == "FULL_MASK" else None

    def glue_target_verify_metadata(self) -> str:
        return "kdev gathers its verify inputs from the batch's custom mask, which is no runner slot"

    # ------------------------------------------------------------------------------------------ metadata hooks
    def init_forward_metadata(self, forward_batch):
        self.fallback.init_forward_metadata(forward_batch)
        self._gather(forward_batch, graph=False)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        self.fallback.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        self._gather(forward_batch, graph=True)

    def init_forward_metadata_in_graph(self, forward_batch):
        self.fallback.init_forward_metadata_in_graph(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args, **kwargs):
        self.fallback.init_cuda_graph_state(max_bs, max_num_tokens, *args, **kwargs)
        dev = self.req_to_token.device
        pages = (self._graph_bound() + self.page_size - 1) // self.page_size
        self.graph_buffers = VerifyBatch(
            torch.zeros(max_bs, pages, dtype=torch.int32, device=dev), torch.zeros(max_bs, dtype=torch.int32, device=dev),
            torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            torch.zeros(max(max_num_tokens, max_bs * self.max_draft), (self.max_draft + 63) // 64, dtype=torch.int64,
                        device=dev), self.max_draft, self._graph_bound())

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs):
        """The draft filled the mask after the metadata hooks ran (overlap plan stream): gather the tree bits again,
        into the same buffers, then the fallback's own update."""
        if self._gathered_from is not None and self.batch is not None:
            req_pool_indices, seq_lens, T, bound, into = self._gathered_from
            self.batch = verify_batch(self.req_to_token, req_pool_indices, seq_lens,
                                      getattr(spec_info, "custom_mask", None), T, self.page_size, bound,
                                      into=into or self.batch)
        self.fallback.update_verify_buffers_to_fill_after_draft(spec_info, cuda_graph_bs)

    def _graph_bound(self) -> int:
        return self.max_context_len + self.max_draft

    def _gather(self, forward_batch, graph: bool) -> None:
        self.batch = self._gathered_from = None
        if not forward_batch.forward_mode.is_target_verify():
            return
        spec = forward_batch.spec_info
        T = num_draft_of(spec)
        into = self.graph_buffers if graph else None
        if into is not None:
            if T > self.max_draft:
                raise convert.ConversionError(f"a verify batch of {T} nodes per request; the graph buffers hold "
                                              f"{self.max_draft}")
            bound = self._graph_bound()
        else:
            lens = getattr(forward_batch, "seq_lens_cpu", None)
            bound = int(lens.max()) + T if lens is not None and len(lens) else self._graph_bound()
        custom_mask = getattr(spec, "custom_mask", None)
        self.batch = verify_batch(self.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                                  custom_mask, T, self.page_size, bound, into=into)
        self._gathered_from = (forward_batch.req_pool_indices, forward_batch.seq_lens, T, bound, into)
        self.stats.verify_steps += 1
        if self.check:
            check_verify_batch(self.batch, custom_mask, self.req_to_token, forward_batch.req_pool_indices,
                               getattr(forward_batch, "positions", None), self.page_size)

    # ------------------------------------------------------------------------------------------------ forward
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if not forward_batch.forward_mode.is_target_verify():
            return self.fallback.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        out = self.verify_forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs.get("q_rope"),
                                  kwargs.get("k_rope"))
        if self.shadow:
            self._shadow_check(out, q, k, v, layer, forward_batch, kwargs)
        return out

    def verify_forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None):
        """The absorbed MLA verify: q [N, H, 576] (or 512 + q_rope's 64), the nodes' latent rows k [N, 1, 576] (or
        512 + k_rope's 64) written at forward_batch.out_cache_loc, then kdev's kernel over prefix + tree; out
        [N, H * 512] in q's dtype, as SGLang's MLA backends return it. On CPU tensors torch.ops.kdev runs kdev's
        float64 reference (kdev/ops.py)."""
        import kdev.ops  # registers torch.ops.kdev

        if self.step_schedule is None:
            self.step_schedule = kdev.ops.StepSchedule(self.kernel)
        if self.batch is None:
            raise RuntimeError("kdev's SGLang backend: TARGET_VERIFY forward without its metadata hook "
                               "(init_forward_metadata or init_forward_metadata_out_graph)")
        pool = self._pool()
        if save_kv_cache and k is not None:
            loc = _write_loc(forward_batch)
            if k_rope is not None:
                pool.set_mla_kv_buffer(layer, loc, k, k_rope)
            else:
                pool.set_kv_buffer(layer, loc, k, v)
        heads = layer.tp_q_head_num
        if q_rope is not None:
            q = torch.cat([q.reshape(-1, heads, cabi.LATENT_DIM), q_rope.reshape(-1, heads, cabi.ROPE_DIM)], -1)
        q = q.reshape(-1, heads, cabi.QK_DIM)
        kv_cache = pool.get_key_buffer(layer.layer_id).view(-1, self.page_size, cabi.QK_DIM)
        b = self.batch
        ws = self.step_schedule.workspace(layer.layer_id, b.prefix_lens, b.q_indptr, heads, self.page_size,
                                          b.max_qlen, b.max_kv_len)
        out, _ = kdev.ops.attend(q.to(torch.bfloat16), kv_cache, b.page_table, b.prefix_lens, b.q_indptr, b.tree_mask,
                                 float(layer.scaling), self.kernel, b.max_qlen, b.max_kv_len, ws)
        self.stats.verify_layer_calls += 1
        return out.to(q.dtype).reshape(-1, heads * cabi.LATENT_DIM)

    def _shadow_check(self, out, q, k, v, layer, forward_batch, kwargs) -> None:
        """The fallback's forward on the same inputs (the KV rows are written already), its largest difference from
        kdev's output recorded per layer. Eager batches only: under capture a host read would break the graph."""
        if out.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        peer = self.fallback.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=False, **kwargs)
        diff = float((out.float() - peer.reshape(out.shape).float()).abs().max()) if out.numel() else 0.0
        lid = layer.layer_id
        st = self.stats
        st.shadow_layer_checks += 1
        st.shadow_max_diff[lid] = max(st.shadow_max_diff.get(lid, 0.0), diff)
        if not diff <= self.shadow_tol:  # NaN flags too
            st.shadow_flags += 1
            log.warning("kdev shadow: layer %d max |kdev - %s| = %.4g, over the tolerance %.4g (verify step %d)",
                        lid, type(self.fallback).__name__, diff, self.shadow_tol, st.verify_steps)
        else:
            log.info("kdev shadow: layer %d max |kdev - %s| = %.4g (verify step %d, %d kdev verify calls)", lid,
                     type(self.fallback).__name__, diff, st.verify_steps, st.verify_layer_calls)


_KV_WRITE_LOC: list = []


def _write_loc(forward_batch):
    """The batch's KV write location as 0.5.23's pools take it (KVWriteLoc, carrying the physical mark), or the bare
    out_cache_loc where SGLang has no KVWriteLoc."""
    if not _KV_WRITE_LOC:
        try:
            _KV_WRITE_LOC.append(importlib.import_module(_POOL_MODULE).KVWriteLoc)
        except (ImportError, AttributeError):
            _KV_WRITE_LOC.append(None)
    cls = _KV_WRITE_LOC[0]
    return cls.for_batch(forward_batch) if cls is not None else forward_batch.out_cache_loc


def _runtime_facts(server_args) -> dict:
    """dcp size, attention DP and the largest draft count, as SGLang resolved them (None where it cannot say)."""
    facts = {"dcp_size": getattr(server_args, "dcp_size", None), "attn_dp": None, "max_draft": None}
    try:
        rt = importlib.import_module(_RUNTIME_MODULE)
    except ImportError:
        return facts
    for key, fn in (("dcp_size", lambda: rt.attn_dcp_size_of(server_args)),
                    ("attn_dp", lambda: rt.attn_dp_enabled_of(server_args)),
                    ("max_draft", rt.max_speculative_num_draft_tokens)):
        try:
            facts[key] = fn()
        except Exception:  # an unresolved config (a test's namespace): keep what server_args said
            pass
    return facts


def create(runner, fallback_name: str, kernel: str | None = None):
    """SGLang's factory for the `kdev` backend: the fallback made by its own factory, wrapped. Refuses, in one line
    (ValueError), what kdev cannot serve: a non-MLA model, an fp8 pool, --dcp-size > 1 (kdev's page table would
    address the whole sequence where each rank holds every dcp_size-th token), a speculative server whose draft has
    no backend it knows."""
    registry = importlib.import_module(_REGISTRY_MODULE)
    if fallback_name not in registry.ATTENTION_BACKENDS or fallback_name == BACKEND_NAME:
        raise ValueError(f"kdev's SGLang backend: fallback {fallback_name!r} is not a registered backend")
    if not getattr(runner, "use_mla_backend", True):
        raise ValueError("kdev's SGLang backend serves MLA models only (kv_lora_rank 512, qk_rope_head_dim 64)")
    args = runner.server_args
    facts = _runtime_facts(args)
    if (facts["dcp_size"] or 1) > 1:
        raise ValueError(f"kdev's SGLang backend does not take --dcp-size {facts['dcp_size']}: each rank's pool holds "
                         "every dcp_size-th token and kdev's page table addresses whole sequences; serve with "
                         "--dcp-size 1")
    if (getattr(args, "speculative_algorithm", None) and not getattr(runner, "is_draft_worker", False)
            and getattr(args, "speculative_draft_attention_backend", None) is None):
        raise ValueError("kdev's SGLang backend serves the target's verify only: name the draft's backend, e.g. "
                         f"--speculative-draft-attention-backend {fallback_name}")
    dtype = getattr(runner, "kv_cache_dtype", torch.bfloat16)
    if dtype != torch.bfloat16:
        raise ValueError(f"kdev's SGLang backend reads a bf16 KV pool; this server's is {dtype} (--kv-cache-dtype): "
                         "serve with a bf16 KV cache or another backend")
    if facts["attn_dp"]:
        log.info("kdev: attention DP: each DP rank verifies its own batch with all of the model's heads on its GPU")
    fallback = registry.ATTENTION_BACKENDS[fallback_name](runner)
    max_draft = facts["max_draft"] or getattr(args, "speculative_num_draft_tokens", None) or cabi.MAX_QLEN
    backend = _sglang_class()(fallback, runner.req_to_token_pool.req_to_token, runner.page_size,
                              runner.model_config.context_len, min(int(max_draft), cabi.MAX_QLEN), kernel,
                              kv_pool=getattr(runner, "token_to_kv_pool", None))
    register_deepseek_dispatch(fallback_name)
    log.info("kdev: TARGET_VERIFY through kdev's %s call, everything else through %s (page size %d)%s",
             backend.kernel, fallback_name, runner.page_size, "; shadow mode on" if backend.shadow else "")
    return backend


def register_deepseek_dispatch(fallback_name: str) -> bool:
    """DeepSeek's models pick their attention path per backend name (AttentionBackendRegistry, whose unknown names get
    triton's handler): under `kdev`, TARGET_VERIFY takes the absorbed MLA path (the one kdev serves) and every other
    mode the fallback's handler. False where SGLang has no such registry."""
    try:
        dispatch = importlib.import_module(_DEEPSEEK_DISPATCH_MODULE)
        mla = importlib.import_module(_DEEPSEEK_METHODS_MODULE).AttnForwardMethod.MLA
    except (ImportError, AttributeError):
        return False
    fallback_handler = dispatch.AttentionBackendRegistry.get_handler(fallback_name)

    def handle_attention_kdev(attn, forward_batch):
        if forward_batch.forward_mode.is_target_verify():
            return mla
        return fallback_handler(attn, forward_batch)

    dispatch.AttentionBackendRegistry.register(BACKEND_NAME, handle_attention_kdev)
    return True


def _sglang_class():
    """KdevVerifyBackend as a subclass of SGLang's AttentionBackend (its forward() dispatches to forward_extend). The
    base class's methods the wrapper does not define call the fallback's; its attributes (class defaults and
    properties) read and write the fallback's, except _OWN_STATE."""
    base = importlib.import_module(_BASE_MODULE).AttentionBackend
    own = {"forward", *(n for n in vars(KdevVerifyBackend) if not n.startswith("__"))}
    members = {}
    for n in dir(base):
        if n.startswith("_") or n in own or n in _OWN_STATE:
            continue
        members[n] = _delegate(n) if callable(getattr(base, n)) else _forwarded(n)
    return type("KdevMLAVerifyBackend", (KdevVerifyBackend, base), members)


def _delegate(name: str):
    def call(self, *args, **kwargs):
        return getattr(self.fallback, name)(*args, **kwargs)

    call.__name__ = name
    return call


def _forwarded(name: str):
    def get(self):
        return getattr(self.fallback, name)

    def put(self, value):
        setattr(self.fallback, name, value)

    return property(get, put, doc=f"the fallback's {name}")


def register(fallback: str | None = None, kernel: str | None = None) -> str:
    """Register the `kdev` attention backend in SGLang's registry and its command line's choices (--attention-backend
    kdev): target-verify through kdev, everything else through `fallback` (default $KDEV_SGLANG_FALLBACK, else triton).
    Returns the name."""
    registry = importlib.import_module(_REGISTRY_MODULE)
    try:  # the command line checks the name against a list that plugins extend
        add_choices = importlib.import_module(_SERVER_ARGS_MODULE).add_attention_backend_choices
    except (ImportError, AttributeError):
        add_choices = None
    if add_choices is not None:
        add_choices([BACKEND_NAME])
    fallback = fallback or os.environ.get("KDEV_SGLANG_FALLBACK", "triton")
    kernel = kernel or os.environ.get("KDEV_SGLANG_KERNEL") or DEFAULT_KERNEL

    @registry.register_attention_backend(BACKEND_NAME)
    def create_kdev_backend(runner):
        return create(runner, fallback, kernel)

    return BACKEND_NAME
