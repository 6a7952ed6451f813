"""kdev's verify kernel in SGLang's MLA target-verify forward; every other forward goes to the server's own backend.

SGLang's attention backends are objects with a fixed set of hooks (base_attn_backend.py's AttentionBackend) made by a
factory registered under a name (attention_registry.py's `register_attention_backend`), both as read at sgl-project/
sglang commit 43681aaa768047065d50fb746c884077a44ed505 (docs/integrations/sglang.md). `KdevVerifyBackend` wraps the
backend the server would otherwise use (the fallback) and takes over one thing: `forward_extend` in TARGET_VERIFY mode,
where it writes the draft nodes' latent rows into the MLA pool and calls torch.ops.kdev.verify_attn on the whole tree.
Every other hook and mode (prefill, decode, draft extend, idle) is the fallback's, attribute for attribute.

The verify inputs come from the batch with device operations only (`verify_batch`): no host read, so that the same code
runs eagerly and while a CUDA graph is captured. Under graphs the backend owns static buffers, sized once in
`init_cuda_graph_state` for the largest batch and the model's context length, filled at capture and refilled in place
before every replay; the flash plan is made for that context length (a bound: shorter requests are correct, their
splits past the end are empty), so a graph replays at any length up to it.

This module imports without SGLang; only `register()` and the factory it registers import SGLang's modules.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kdev import cabi
from kdev.integrations.sglang import convert

BACKEND_NAME = "kdev"
# Where SGLang's registry and base class live (the release docs/integrations/sglang.md names)
_REGISTRY_MODULE = "sglang.srt.layers.attention.attention_registry"
_BASE_MODULE = "sglang.srt.layers.attention.base_attn_backend"
_SERVER_ARGS_MODULE = "sglang.srt.server_args"


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


def verify_batch(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                 custom_mask: torch.Tensor, num_draft: int, page_size: int, max_kv_len: int,
                 into: VerifyBatch | None = None) -> VerifyBatch:
    """SGLang's target-verify batch -> kdev's inputs, by device operations alone (graph-capturable).

    seq_lens are the prefix lengths (the draft nodes come after them); request b's nodes are rows b*T .. b*T + T - 1 of
    q, their KV in req_to_token[req_pool_indices[b], L_b .. L_b + T - 1] (SGLang assigns them there before the verify
    forward); custom_mask is SGLang's FULL_MASK (request after request, T x (L_b + T) entries). The tree part of each
    row is gathered from it; the prefix part is not read (kdev's nodes see the whole prefix: `convert` checks it where
    a host read is allowed). Pages: entry p of request b is the page holding its position p * page_size. With `into`
    (static buffers of at least this size), the results are written into them and views of them returned."""
    bs, T = req_pool_indices.shape[0], num_draft
    dev = custom_mask.device
    lens = seq_lens.to(torch.int64)
    row_len = lens + T
    starts = torch.cumsum(T * row_len, 0) - T * row_len  # SGLang's mask_indptr[:-1]
    i = torch.arange(T, device=dev)
    idx = starts[:, None, None] + i[None, :, None] * row_len[:, None, None] + lens[:, None, None] + i[None, None, :]
    # a padded request of a replayed graph may point past the mask: clamp (its rows are discarded)
    idx = idx.clamp_(0, max(custom_mask.numel() - 1, 0)).view(bs * T, T)
    words = into.tree_mask.shape[1] if into is not None else (T + 63) // 64
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


def check_verify_batch(batch: VerifyBatch, custom_mask: torch.Tensor, req_to_token: torch.Tensor,
                       req_pool_indices: torch.Tensor, positions: torch.Tensor | None, page_size: int) -> None:
    """What verify_batch takes on trust, checked with host reads (kdev's eager conversions, `convert`): the mask is a
    tree with every prefix column set, the slots form whole pages, positions are prefix + depth. ConversionError names
    the first request, node or position that is not so. For debugging a deploy (KDEV_SGLANG_CHECK=1), not for serving."""
    T = batch.max_qlen
    row_len = batch.prefix_lens.to(torch.int64) + T
    mask_indptr = torch.cat([row_len.new_zeros(1), torch.cumsum(T * row_len, 0)])
    tree = convert.custom_mask_to_tree_mask(custom_mask, mask_indptr, batch.prefix_lens, batch.q_indptr,
                                            batch.tree_mask.shape[1])
    if not torch.equal(tree, batch.tree_mask):
        raise convert.ConversionError("the gathered tree mask differs from the checked conversion")
    convert.token_slots_to_page_table(req_to_token, req_pool_indices, row_len, page_size)
    if positions is not None:
        convert.check_positions(positions, batch.prefix_lens, batch.q_indptr, batch.tree_mask)


class KdevVerifyBackend:
    """The fallback backend with TARGET_VERIFY's forward_extend replaced by kdev's verify kernel (module docstring).

    fallback: the backend object the server would use (any attribute not defined here is the fallback's);
    req_to_token: SGLang's req_to_token table; page_size: the pool's tokens per page (kdev's page rule);
    max_context_len: the longest request the server takes (the bound of the plan under graphs);
    num_draft: nodes per tree (speculative_num_draft_tokens); kernel: kdev's verify kernel (flash, flash-portable, or
    flash-scheduled / flash-portable-scheduled: split by each request's own length on the GPU, where the plain call
    splits every request as one of max_context_len tokens, the bound a captured graph holds).
    """

    def __init__(self, fallback, req_to_token: torch.Tensor, page_size: int, max_context_len: int, num_draft: int,
                 kernel: str = "flash", check: bool | None = None):
        problem = cabi.page_size_problem(page_size)
        if problem:
            raise convert.ConversionError(problem)
        if not 1 <= num_draft <= cabi.MAX_QLEN:
            raise convert.ConversionError(f"{num_draft} draft tokens per request: kdev takes 1 to {cabi.MAX_QLEN}")
        self.fallback, self.req_to_token, self.page_size = fallback, req_to_token, page_size
        self.max_context_len, self.num_draft, self.kernel = max_context_len, num_draft, kernel
        self.check = os.environ.get("KDEV_SGLANG_CHECK") == "1" if check is None else check
        self.graph_buffers: VerifyBatch | None = None
        self.batch: VerifyBatch | None = None  # this forward's verify inputs (TARGET_VERIFY only)
        self.step_schedule = None  # a scheduled kernel's, once per forward (kdev.ops.StepSchedule; made on first use)

    def __getattr__(self, name):  # only for what this class does not define: the fallback's hooks and state
        if name == "fallback":
            raise AttributeError(name)
        return getattr(self.fallback, name)

    # ------------------------------------------------------------------------------------------ metadata hooks
    def init_forward_metadata(self, forward_batch):
        self.fallback.init_forward_metadata(forward_batch)
        self.batch = None
        if forward_batch.forward_mode.is_target_verify():
            lens = getattr(forward_batch, "seq_lens_cpu", None)
            bound = int(lens.max()) + self.num_draft if lens is not None and len(lens) else self._graph_bound()
            spec = forward_batch.spec_info
            self.batch = verify_batch(self.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                                      spec.custom_mask, self.num_draft, self.page_size, bound)
            if self.check:
                check_verify_batch(self.batch, spec.custom_mask, self.req_to_token, forward_batch.req_pool_indices,
                                   forward_batch.positions, self.page_size)

    def _graph_bound(self) -> int:
        return self.max_context_len + self.num_draft

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args, **kwargs):
        self.fallback.init_cuda_graph_state(max_bs, max_num_tokens, *args, **kwargs)
        dev = self.req_to_token.device
        pages = (self._graph_bound() + self.page_size - 1) // self.page_size
        self.graph_buffers = VerifyBatch(
            torch.zeros(max_bs, pages, dtype=torch.int32, device=dev), torch.zeros(max_bs, dtype=torch.int32, device=dev),
            torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            torch.zeros(max(max_num_tokens, max_bs * self.num_draft), (self.num_draft + 63) // 64, dtype=torch.int64,
                        device=dev), self.num_draft, self._graph_bound())

    def _fill_graph_batch(self, bs, req_pool_indices, seq_lens, forward_mode, spec_info) -> None:
        if not forward_mode.is_target_verify():
            return
        if self.graph_buffers is None:
            raise RuntimeError("kdev's SGLang backend: a graph hook ran before init_cuda_graph_state")
        self.batch = verify_batch(self.req_to_token, req_pool_indices[:bs], seq_lens[:bs], spec_info.custom_mask,
                                  self.num_draft, self.page_size, self._graph_bound(), into=self.graph_buffers)

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info, *args, **kwargs):
        self.fallback.init_forward_metadata_capture_cuda_graph(bs, num_tokens, req_pool_indices, seq_lens,
                                                               encoder_lens, forward_mode, spec_info, *args, **kwargs)
        self._fill_graph_batch(bs, req_pool_indices, seq_lens, forward_mode, spec_info)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, *args, **kwargs):
        self.fallback.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, seq_lens_sum,
                                                              encoder_lens, forward_mode, spec_info, *args, **kwargs)
        self._fill_graph_batch(bs, req_pool_indices, seq_lens, forward_mode, spec_info)

    # ------------------------------------------------------------------------------------------------ forward
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if not forward_batch.forward_mode.is_target_verify():
            return self.fallback.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        return self.verify_forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs.get("q_rope"),
                                   kwargs.get("k_rope"))

    def verify_forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None):
        """The absorbed MLA verify: q [N, H, 576] (or 512 + q_rope's 64), the nodes' latent rows k [N, 1, 576] (or
        512 + k_rope's 64) written at forward_batch.out_cache_loc, then kdev's kernel over prefix + tree; out
        [N, H * 512] in q's dtype, as SGLang's MLA backends return it."""
        import kdev.ops  # registers torch.ops.kdev

        if self.step_schedule is None:
            self.step_schedule = kdev.ops.StepSchedule(self.kernel)
        if self.batch is None:
            raise RuntimeError("kdev's SGLang backend: TARGET_VERIFY forward without its metadata hook")
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache and k is not None:
            if k_rope is not None:
                pool.set_mla_kv_buffer(layer, forward_batch.out_cache_loc, k, k_rope)
            else:
                pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
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
        return out.to(q.dtype).reshape(-1, heads * cabi.LATENT_DIM)


def create(runner, fallback_name: str, kernel: str = "flash"):
    """SGLang's factory for the `kdev` backend: the fallback made by its own factory, wrapped."""
    import importlib

    registry = importlib.import_module(_REGISTRY_MODULE)
    if fallback_name not in registry.ATTENTION_BACKENDS or fallback_name == BACKEND_NAME:
        raise ValueError(f"kdev's SGLang backend: fallback {fallback_name!r} is not a registered backend")
    if not getattr(runner, "use_mla_backend", True):
        raise ValueError("kdev's SGLang backend serves MLA models only (kv_lora_rank 512, qk_rope_head_dim 64)")
    fallback = registry.ATTENTION_BACKENDS[fallback_name](runner)
    return _sglang_class()(fallback, runner.req_to_token_pool.req_to_token, runner.page_size,
                           runner.model_config.context_len, runner.server_args.speculative_num_draft_tokens, kernel)


def _sglang_class():
    """KdevVerifyBackend as a subclass of SGLang's AttentionBackend (its forward() dispatches to forward_extend)."""
    import importlib

    base = importlib.import_module(_BASE_MODULE).AttentionBackend
    # the fallback's hooks win over the base class's NotImplementedError stubs: the wrapper lists them first
    # (forward stays the base class's: it dispatches to this class's forward_extend)
    own = {"forward", *(n for n in vars(KdevVerifyBackend) if not n.startswith("__"))}
    delegated = {n: _delegate(n) for n in dir(base)
                 if not n.startswith("_") and n not in own and callable(getattr(base, n))}
    return type("KdevMLAVerifyBackend", (KdevVerifyBackend, base), delegated)


def _delegate(name: str):
    def call(self, *args, **kwargs):
        return getattr(self.fallback, name)(*args, **kwargs)

    call.__name__ = name
    return call


def register(fallback: str | None = None, kernel: str | None = None) -> str:
    """Register the `kdev` attention backend in SGLang's registry and its command line's choices (--attention-backend
    kdev): target-verify through kdev, everything else through `fallback` (default $KDEV_SGLANG_FALLBACK, else triton).
    Returns the name."""
    import importlib

    registry = importlib.import_module(_REGISTRY_MODULE)
    try:  # the command line checks the name against a list that plugins extend
        add_choices = importlib.import_module(_SERVER_ARGS_MODULE).add_attention_backend_choices
    except (ImportError, AttributeError):
        add_choices = None
    if add_choices is not None:
        add_choices([BACKEND_NAME])
    fallback = fallback or os.environ.get("KDEV_SGLANG_FALLBACK", "triton")
    kernel = kernel or os.environ.get("KDEV_SGLANG_KERNEL", "flash")

    @registry.register_attention_backend(BACKEND_NAME)
    def create_kdev_backend(runner):
        return create(runner, fallback, kernel)

    return BACKEND_NAME
