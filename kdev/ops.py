"""The library's entry points as torch custom ops, the way serving engines call custom kernels.

    torch.ops.kdev.verify_attn(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale, kernel,
                               max_qlen, max_kv_len) -> (out, lse)
    torch.ops.kdev.verify_attn_with_workspace(..., max_kv_len, workspace) -> (out, lse)   (workspace written)
    torch.ops.kdev.verify_schedule(prefix_lens, q_indptr, num_heads, page_size, kernel, max_qlen, max_kv_len)
        -> workspace
    torch.ops.kdev.build_ddtree(log_probs, token_ids, root_tokens, prefix_lens, budget)
        -> (node_tokens, parents, depths, positions, tree_mask, node_count)
    torch.ops.kdev.accept_greedy(node_tokens, parents, node_count, target_argmax) -> (accepted, accept_len, bonus_token)
    torch.ops.kdev.compact_kv(kv_cache, page_table, prefix_lens, accepted, accept_len) -> ()   (kv_cache in place)

On CUDA tensors each runs the library's kernel (through kdev/abi.py, the one binding) on the current stream; it
allocates its outputs (and the flash call's workspace) from torch's allocator, so it can be captured in a CUDA graph.
On CPU tensors it runs the float64 / exact reference (kdev/mla.py, kdev/ddtree.py), so the same model code runs without
a GPU. Each op has a fake implementation (shapes and dtypes only) for torch.compile: the op is one node of the graph,
no break around it. Arguments are checked as the CLI checks them (abi.check_inputs: one line, AbiArgumentError).

`kernel` picks the verify call by its name in kdev/registry.py: "flash" (the default, Hopper's product) or
"flash-portable" (sm_120's), both on the device schedule; "naive" (the oracle) and the host-planned references.
`max_qlen` / `max_kv_len` are the call's bounds; 0 computes them from the tensors (a device-to-host read: pass them
under graph capture). In verify_attn a scheduled call makes its device schedule in each call; verify_attn_with_workspace takes a workspace that verify_schedule made for these lengths
instead: an engine makes the schedule once per decoding step and every layer's call reads it (the calls write their
partials into the same workspace, one after the other on the stream). Importing this module registers the ops.
"""

from __future__ import annotations

import numpy as np
import torch

from kdev import abi, cabi, ddtree, mla, registry

_LIBRARY: list = []  # the library the CUDA ops run, loaded on first use


def library() -> abi.Library:
    """The library the CUDA ops run: $KDEV_LIB, else the last `kdev build` with code for this GPU. A serving process
    never starts nvcc: without a built library it is refused in one line (abi.load_library)."""
    if not _LIBRARY:
        _LIBRARY.append(abi.load_library(build=False))
    return _LIBRARY[0]


def use_library(lib: abi.Library) -> None:
    """The library the CUDA ops run from now on (a command that built or chose one; a server names it by KDEV_LIB)."""
    _LIBRARY[:] = [lib]


def _tree_kernels() -> abi.TreeKernels:
    return abi.TreeKernels(library())


# ------------------------------------------------------------------------------------------------ verify
def _verify_attn(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale, kernel, max_qlen, max_kv_len,
                 workspace):
    x = abi.VerifyInputs(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale,
                         max_qlen or None, max_kv_len or None)
    n_q, heads, _ = q.shape
    if q.device.type == "cpu":
        out = torch.empty(n_q, heads, cabi.LATENT_DIM, dtype=torch.bfloat16)
        lse = torch.empty(n_q, heads, dtype=torch.float32)
        abi.check_inputs(x, out, lse)
        ref_out, ref_lse = mla.reference_verify_attn(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale)
        return ref_out.to(torch.bfloat16), ref_lse.to(torch.float32)
    if kernel not in abi.VERIFY_KERNELS:
        raise abi.AbiArgumentError(f"kernel {kernel!r}: one of {', '.join(abi.VERIFY_KERNELS)}")
    lib = library()
    out = torch.empty(n_q, heads, cabi.LATENT_DIM, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(n_q, heads, dtype=torch.float32, device=q.device)
    if workspace is not None:  # verify_schedule's: the schedule for these lengths is in it
        if kernel not in abi.SPLIT_KV_KERNELS:
            raise abi.AbiArgumentError(f"workspace: kernel {kernel!r} takes none")
        p = lib.params(x, out, lse, workspace)
        made = getattr(workspace, "_kdev_schedule", None)
        if kernel in abi.SCHEDULED_KERNELS and made is not None and made != _schedule_key(p):
            # the kernels would find no work for these shapes and leave the outputs unwritten: refused here instead
            raise abi.AbiArgumentError(f"workspace: its schedule was made for batch, heads, page size and bounds "
                                       f"{made}, this call is {_schedule_key(p)}")
        lib.call(kernel, p, schedule=False)
        return out, lse
    p = lib.params(x, out, lse)
    if kernel in abi.SPLIT_KV_KERNELS:
        need = lib.workspace_size(p)
        if need:
            workspace = torch.empty(need, dtype=torch.uint8, device=q.device)
            p.workspace, p.workspace_bytes = workspace.data_ptr(), need
    lib.call(kernel, p)
    return out, lse


def _outputs_like(q):
    n_q, heads, _ = q.shape
    return (q.new_empty(n_q, heads, cabi.LATENT_DIM, dtype=torch.bfloat16),
            q.new_empty(n_q, heads, dtype=torch.float32))


# Two ops, not one with an optional workspace: a mutated argument must not have a default, since torch releases that
# strip trailing default arguments from a call (None among them) then index the mutated one past the call's end.
@torch.library.custom_op("kdev::verify_attn", mutates_args=())
def verify_attn(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, prefix_lens: torch.Tensor,
                q_indptr: torch.Tensor, tree_mask: torch.Tensor, scale: float, kernel: str = registry.DEFAULT,
                max_qlen: int = 0, max_kv_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return _verify_attn(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale, kernel, max_qlen,
                        max_kv_len, None)


@verify_attn.register_fake
def _(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale, kernel=registry.DEFAULT, max_qlen=0,
      max_kv_len=0):
    return _outputs_like(q)


@torch.library.custom_op("kdev::verify_attn_with_workspace", mutates_args=("workspace",))
def verify_attn_with_workspace(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
                               prefix_lens: torch.Tensor, q_indptr: torch.Tensor, tree_mask: torch.Tensor,
                               scale: float, kernel: str, max_qlen: int, max_kv_len: int,
                               workspace: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _verify_attn(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale, kernel, max_qlen,
                        max_kv_len, workspace)


@verify_attn_with_workspace.register_fake
def _(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale, kernel, max_qlen, max_kv_len, workspace):
    return _outputs_like(q)


def attend(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale, kernel, max_qlen, max_kv_len,
           workspace=None):
    """verify_attn, or verify_attn_with_workspace where there is a workspace (StepSchedule.workspace's answer)."""
    args = (q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale, kernel, max_qlen, max_kv_len)
    if workspace is None:
        return torch.ops.kdev.verify_attn(*args)
    return torch.ops.kdev.verify_attn_with_workspace(*args, workspace)


def _schedule_key(p) -> tuple:
    return p.batch, p.num_heads, p.page_size, p.max_qlen, p.max_kv_len


def _schedule_bytes(prefix_lens, q_indptr, num_heads, page_size, kernel, max_qlen, max_kv_len) -> tuple:
    if kernel not in abi.SCHEDULED_KERNELS:
        raise abi.AbiArgumentError(f"kernel {kernel!r}: a schedule is made for {' or '.join(abi.SCHEDULED_KERNELS)}")
    if max_qlen < 1 or max_kv_len < 1:
        raise abi.AbiArgumentError(f"bounds {max_qlen} / {max_kv_len}: a schedule needs the call's bounds (>= 1)")
    if prefix_lens.device.type == "cpu":  # the reference needs no schedule
        return None, 0
    lib = library()
    p = lib.plan_params(prefix_lens, q_indptr, num_heads, page_size, max_qlen, max_kv_len)
    return p, lib.workspace_size(p)


@torch.library.custom_op("kdev::verify_schedule", mutates_args=())
def verify_schedule(prefix_lens: torch.Tensor, q_indptr: torch.Tensor, num_heads: int, page_size: int, kernel: str,
                    max_qlen: int, max_kv_len: int) -> torch.Tensor:
    """The device schedule of a scheduled verify kernel for these lengths, made on the current stream into a new
    workspace (uint8) that every verify_attn call with the same lengths, bounds, heads and page size takes. On CPU
    tensors: an empty tensor (the reference runs without one)."""
    p, need = _schedule_bytes(prefix_lens, q_indptr, num_heads, page_size, kernel, max_qlen, max_kv_len)
    workspace = torch.empty(need, dtype=torch.uint8, device=prefix_lens.device)
    if p is not None:
        p.workspace, p.workspace_bytes = workspace.data_ptr(), need
        library().schedule(p)
        workspace._kdev_schedule = _schedule_key(p)
    return workspace


@verify_schedule.register_fake
def _(prefix_lens, q_indptr, num_heads, page_size, kernel, max_qlen, max_kv_len):
    _, need = _schedule_bytes(prefix_lens, q_indptr, num_heads, page_size, kernel, max_qlen, max_kv_len)
    return prefix_lens.new_empty(need, dtype=torch.uint8)


class StepSchedule:
    """A scheduled kernel's device schedule in a model's forward: made by the forward's first layer (the layer that
    made the last one) and read by every later layer's verify_attn. Made in a layer's call, not before the forward:
    under a captured CUDA graph the schedule kernel is then part of the graph, and every replay makes it from the
    replay's lengths. None for the other kernels (each call plans for itself)."""

    def __init__(self, kernel: str):
        self.kernel = kernel
        self.made: tuple | None = None  # (the first layer, heads, workspace)

    def workspace(self, layer: int, prefix_lens: torch.Tensor, q_indptr: torch.Tensor, heads: int, page_size: int,
                  max_qlen: int, max_kv_len: int) -> torch.Tensor | None:
        if self.kernel not in abi.SCHEDULED_KERNELS:
            return None
        made = self.made
        if made is None or made[0] == layer or made[1] != heads:
            ws = torch.ops.kdev.verify_schedule(prefix_lens, q_indptr, heads, page_size, self.kernel, max_qlen,
                                                max_kv_len)
            self.made = made = (made[0] if made else layer, heads, ws)
        return made[2]


# ------------------------------------------------------------------------------------------------- trees
@torch.library.custom_op("kdev::build_ddtree", mutates_args=())
def build_ddtree(log_probs: torch.Tensor, token_ids: torch.Tensor, root_tokens: torch.Tensor,
                 prefix_lens: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor, torch.Tensor, torch.Tensor]:
    if log_probs.device.type != "cpu":
        out = _tree_kernels().build_ddtree(log_probs, token_ids, root_tokens, prefix_lens, budget)
        return tuple(out[k] for k in ("node_tokens", "parents", "depths", "positions", "tree_mask", "node_count"))
    B, t = log_probs.shape[0], 1 + budget
    W = (t + 63) // 64
    tokens, parents, depths, positions = (torch.full((B, t), -1, dtype=torch.int32) for _ in range(4))
    mask = torch.zeros(B, t, W, dtype=torch.int64)
    count = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        dist = ddtree.DrafterDist(log_probs[b].numpy(), token_ids[b].numpy().astype(np.int64))
        tree = ddtree.build_ddtree(dist, budget, int(root_tokens[b]))
        n = tree.size
        tokens[b, :n] = torch.from_numpy(tree.tokens)
        parents[b, :n] = torch.from_numpy(tree.parents)
        depths[b, :n] = torch.from_numpy(tree.depths)
        positions[b, :n] = torch.from_numpy(tree.positions(int(prefix_lens[b])))
        mask[b, :n] = torch.from_numpy(ddtree.tree_mask_rows(tree, W).view(np.int64))
        count[b] = n
    return tokens, parents, depths, positions, mask, count


@build_ddtree.register_fake
def _(log_probs, token_ids, root_tokens, prefix_lens, budget):
    B, t = log_probs.shape[0], 1 + budget
    i32 = log_probs.new_empty(B, t, dtype=torch.int32)
    return (i32, i32.clone(), i32.clone(), i32.clone(),
            log_probs.new_empty(B, t, (t + 63) // 64, dtype=torch.int64), log_probs.new_empty(B, dtype=torch.int32))


def _tree_of(tokens: torch.Tensor, parents: torch.Tensor, n: int) -> ddtree.Tree:
    par = parents[:n].numpy().astype(np.int64)
    depth = np.zeros(n, np.int64)
    for i in range(1, n):
        depth[i] = depth[par[i]] + 1
    return ddtree.Tree(tokens[:n].numpy().astype(np.int64), par, depth)


@torch.library.custom_op("kdev::accept_greedy", mutates_args=())
def accept_greedy(node_tokens: torch.Tensor, parents: torch.Tensor, node_count: torch.Tensor,
                  target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if node_tokens.device.type != "cpu":
        return tuple(_tree_kernels().accept_greedy(node_tokens, parents, node_count, target_argmax))
    B, T = node_tokens.shape
    accepted = torch.full((B, T), -1, dtype=torch.int32)
    length = torch.zeros(B, dtype=torch.int32)
    bonus = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        n = int(node_count[b])
        acc = ddtree.accept_greedy(_tree_of(node_tokens[b], parents[b], n), target_argmax[b, :n].numpy())
        accepted[b, :len(acc.nodes)] = torch.from_numpy(np.asarray(acc.nodes))
        length[b], bonus[b] = len(acc.nodes), acc.bonus_token
    return accepted, length, bonus


@accept_greedy.register_fake
def _(node_tokens, parents, node_count, target_argmax):
    B, T = node_tokens.shape
    return (node_tokens.new_empty(B, T, dtype=torch.int32), node_tokens.new_empty(B, dtype=torch.int32),
            node_tokens.new_empty(B, dtype=torch.int32))


@torch.library.custom_op("kdev::compact_kv", mutates_args=("kv_cache",))
def compact_kv(kv_cache: torch.Tensor, page_table: torch.Tensor, prefix_lens: torch.Tensor, accepted: torch.Tensor,
               accept_len: torch.Tensor) -> None:
    if kv_cache.device.type != "cpu":
        _tree_kernels().compact_kv(kv_cache, page_table, prefix_lens, accepted, accept_len)
        return
    bits = kv_cache.view(torch.int16)
    for b in range(accepted.shape[0]):
        n = int(accept_len[b])
        moved = ddtree.compact_kv(bits.numpy(), page_table[b].numpy(), int(prefix_lens[b]), accepted[b, :n].numpy())
        bits.copy_(torch.from_numpy(moved))


@compact_kv.register_fake
def _(kv_cache, page_table, prefix_lens, accepted, accept_len):
    return None
