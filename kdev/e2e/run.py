"""Tree speculative decoding against plain greedy decoding, token for token (kdev e2e).

Per batch of prompts and node budget: prefill (each prompt as chains through the adapter), then rounds of draft ->
DDTree build (torch.ops.kdev.build_ddtree) -> one verify forward over every tree -> greedy accept
(torch.ops.kdev.accept_greedy) -> KV compaction (torch.ops.kdev.compact_kv) -> the bonus token as the next root. On
CUDA the ops are kdev's kernels; on the CPU their references. The emitted tokens are compared with the oracle's greedy
tokens: in float64 (backend `reference`) every difference fails; with bf16 kernels a difference is excused only where
the oracle's top-2 logit gap at that position is within TIE_REL of the larger logit (docs/e2e.md derives it), and a
prompt is compared no further than its first excused position (the two decodings then see different text).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kdev import cabi, ops  # noqa: F401  (ops: importing it registers torch.ops.kdev)
from kdev.e2e import adapter, oracle
from kdev.e2e.drafter import OracleDrafter
from kdev.errors import BadInput

# bf16 verify attention: each layer's latent output carries its rounding (2^-9 relative) and the kernel's bf16 P in
# P.V (another 2^-9); through the residual stream both reach the logits of every later layer. Two roundings per
# layer, two layers' worth of margin, on both logits of the pair: 2 x 2 x 2 x 2^-9 = 2^-6 of the larger logit.
TIE_REL = 2.0**-6
MUTANTS = ("mask-bit", "kv-position", "compact-slot")


@dataclass
class Difference:
    prompt: int
    round: int  # 0: the prefill's token
    position: int  # index among the generated tokens
    got: int
    want: int
    gap: float
    excused: bool

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class BudgetResult:
    budget: int
    page_size: int
    backend: str
    rounds: int
    prompts: int
    tokens: int  # emitted and compared
    accepted_per_round: float  # drafted tokens accepted, mean per request and round
    tokens_per_round: float  # accepted + the bonus token
    seconds: dict = field(default_factory=dict)  # stage -> total seconds
    differences: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not any(not d.excused for d in self.differences)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["differences"] = [x.to_dict() for x in self.differences]
        d["passed"] = self.passed
        return d


@dataclass(frozen=True)
class Settings:
    prompts: int = 8
    rounds: int = 16
    budgets: tuple = (16,)
    page_size: int = 64
    backend: str = "reference"
    depth: int = 8
    topk: int = 4
    agree: float = 0.7
    min_prompt: int = 8
    max_prompt: int = 48
    seed: int = 0
    mutant: str | None = None
    graph: bool = False  # each budget's verify forward captured in a CUDA graph and replayed (CUDA only)
    prefill_chunk: int = cabi.MAX_QLEN - 1  # prompt tokens per prefill forward (a chain of at most MAX_QLEN rows)

    def check(self, model) -> None:
        for b in self.budgets:
            if not 1 <= b <= cabi.MAX_BUDGET:
                raise BadInput(f"--budget {b}: 1 to {cabi.MAX_BUDGET} nodes besides the root (kdev's largest tree)")
        if self.prompts < 1 or self.rounds < 1:
            raise BadInput("--prompts and --rounds: at least 1")
        if self.topk < 1 or self.topk > cabi.MAX_TOPK:
            raise BadInput(f"--topk {self.topk}: the drafter proposes 1 to {cabi.MAX_TOPK} tokens per depth")
        if not 1 <= self.depth <= cabi.MAX_DEPTH:
            raise BadInput(f"--depth {self.depth}: 1 to {cabi.MAX_DEPTH}")
        problem = cabi.page_size_problem(self.page_size)
        if problem:
            raise BadInput(f"--page-size: {problem}")
        if not 1 <= self.min_prompt <= self.max_prompt or self.max_prompt > cabi.MAX_PREFIX:
            raise BadInput(f"prompt lengths {self.min_prompt}..{self.max_prompt}: 1 to {cabi.MAX_PREFIX} tokens")
        if not 1 <= self.prefill_chunk <= cabi.MAX_QLEN:
            raise BadInput(f"prefill chunk {self.prefill_chunk}: 1 to {cabi.MAX_QLEN} tokens (one chain per call)")
        longest = self.max_prompt + 1 + self.rounds * (self.depth + 1) + self.depth
        if longest > model.config.max_position_embeddings:
            raise BadInput(f"a prompt of {self.max_prompt} tokens and {self.rounds} rounds reach position {longest}, "
                           f"past the model's {model.config.max_position_embeddings}")
        if self.backend not in adapter.BACKENDS:
            raise BadInput(f"--backend {self.backend!r}: one of {', '.join(adapter.BACKENDS)}")
        if not 0.0 <= self.agree <= 1.0:
            raise BadInput(f"--agree {self.agree}: between 0 and 1")
        if self.mutant is not None and self.mutant not in MUTANTS:
            raise BadInput(f"mutant {self.mutant!r}: one of {', '.join(MUTANTS)}")


def prompts_for(settings: Settings, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(settings.seed)
    lens = rng.integers(settings.min_prompt, settings.max_prompt + 1, settings.prompts)
    return [rng.integers(0, vocab, int(n)).tolist() for n in lens]


def references(model, prompts: list[list[int]], settings: Settings) -> list[oracle.Reference]:
    """Enough greedy tokens for every round to accept its whole depth, and the drafter's look-ahead past it."""
    n = 1 + settings.rounds * (settings.depth + 1) + settings.depth
    return [oracle.greedy(model, p, n) for p in prompts]


class _Clock:
    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.seconds: dict = {}

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def stage(self, name: str):
        """Adds the seconds of the enclosed work (the GPU's too: synchronised on either side) to the stage's total."""
        self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def _logits(model, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The model's own modules in its order (embedding, rotary table, decoder layers, norm, LM head), without the
    causal mask the model would build for its stock attention: the adapter takes the tree mask, and the mask's host
    checks could not be captured in a CUDA graph."""
    m = model.model
    with torch.no_grad():
        hidden = m.embed_tokens(tokens[None])
        pos = positions[None]
        emb = m.rotary_emb(hidden, pos)
        for layer in m.layers:
            hidden = layer(hidden, attention_mask=None, position_ids=pos, position_embeddings=emb)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        return model.lm_head(m.norm(hidden))[0]


class _GraphedVerify:
    """One budget's verify forward captured once in a CUDA graph and replayed every round, as a server runs it: the
    trees' tokens, positions and kdev's contract tensors are static and refilled in place; the flash plan is made for
    the cache's length (a bound) and B x (budget + 1) rows."""

    def __init__(self, model, latent, batch: int, nodes: int, bound: int, mutant, device):
        self.model, self.latent, self.nodes, self.graph, self.out = model, latent, nodes, None, None
        n = batch * nodes
        self.tokens = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.step = adapter.VerifyStep(
            torch.arange(0, (batch + 1) * nodes, nodes, dtype=torch.int32, device=device),
            torch.zeros(batch, dtype=torch.int32, device=device),
            torch.zeros(n, (nodes + 63) // 64, dtype=torch.int64, device=device),
            torch.arange(batch, device=device).repeat_interleave(nodes), torch.zeros(n, dtype=torch.long, device=device),
            nodes, bound, mutant)

    def __call__(self, prefix: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        st = self.step
        st.prefix_lens.copy_(prefix)
        st.tree_mask.copy_(mask)
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        st.position.copy_(st.prefix_lens.long()[st.request] + torch.arange(self.nodes, device=st.position.device).repeat(
            len(st.prefix_lens)))
        self.latent.step = st
        self.latent.timed = False
        if self.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                _logits(self.model, self.tokens, self.positions)  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = _logits(self.model, self.tokens, self.positions)
        self.latent.timed = True
        self.graph.replay()
        return self.out


def run_budget(model, prompts, refs, settings: Settings, budget: int, device="cpu", progress=None) -> BudgetResult:
    """One budget: prefill, settings.rounds rounds, the comparison."""
    B, D = len(prompts), settings.depth
    reference = settings.backend == "reference"
    dtype = torch.float64 if reference else torch.bfloat16
    max_len = max(map(len, prompts)) + 2 + settings.rounds * (D + 1) + budget + 1
    cache = adapter.PagedLatentCache(len(model.model.layers), B, max_len, settings.page_size, dtype, device,
                                     settings.seed + 1)
    clock = _Clock(device)
    latent = adapter.LatentAttention(cache, settings.backend, clock.sync)
    drafter = OracleDrafter(D, settings.topk, model.config.vocab_size, settings.agree, settings.seed + 2)
    stock = adapter.swap_attention(model, latent)
    emitted: list[list[int]] = [[] for _ in range(B)]
    emitted_round: list[list[int]] = [[] for _ in range(B)]
    accepted_total = 0
    graphed = None
    try:
        # prefill: each prompt as chains of up to prefill_chunk tokens, each after the chunks before it (a prompt
        # already done takes no rows); the first generated token is the argmax at a prompt's last position
        lens = [len(p) for p in prompts]
        done = [0] * B
        while any(d < n for d, n in zip(done, lens)):
            sizes = [min(settings.prefill_chunk, n - d) for d, n in zip(done, lens)]
            words = max(1, (max(sizes) + 63) // 64)  # one mask width for the batch
            mask = torch.from_numpy(np.concatenate([_chain_mask(t, words) for t in sizes]).view(np.int64))
            step = _step(sizes, done, mask, max(sizes), max(d + t for d, t in zip(done, sizes)), settings.mutant,
                         device)
            tokens = torch.tensor(sum((p[d:d + t] for p, d, t in zip(prompts, done, sizes)), []))
            logits = _forward(model, latent, step, tokens, torch.cat([d + torch.arange(t) for d, t in zip(done, sizes)]),
                              clock, device)
            ends = np.cumsum(sizes) - 1
            for b in range(B):
                done[b] += sizes[b]
                if sizes[b] and done[b] == lens[b]:
                    emitted[b].append(int(logits[ends[b]].argmax()))
                    emitted_round[b].append(0)
        L = torch.tensor(lens, dtype=torch.int32)
        for r in range(1, settings.rounds + 1):
            with clock.stage("draft"):
                lp, ids = zip(*(drafter.propose(refs[b].tokens[len(emitted[b]):len(emitted[b]) + D]) for b in range(B)))
            roots = torch.tensor([e[-1] for e in emitted], dtype=torch.int32)
            with clock.stage("tree build"):
                tree = torch.ops.kdev.build_ddtree(torch.from_numpy(np.stack(lp)).to(device),
                                                   torch.from_numpy(np.stack(ids).astype(np.int32)).to(device),
                                                   roots.to(device), L.to(device), budget)
            tokens, parents, depths, positions, masks, count = (t.cpu() for t in tree)
            n = count.tolist()
            flat_tokens = torch.cat([tokens[b, :n[b]] for b in range(B)]).long()
            flat_pos = torch.cat([positions[b, :n[b]] for b in range(B)]).long()
            flat_mask = torch.cat([masks[b, :n[b]] for b in range(B)])
            if settings.graph:
                if set(n) != {budget + 1}:
                    raise BadInput(f"--graph: a tree of {min(n)} nodes, not budget + 1: the drafter's depth x top-k "
                                   "cannot fill the budget")
                graphed = graphed or _GraphedVerify(model, latent, B, budget + 1, max_len, settings.mutant, device)
                with clock.stage("verify forward (graph)"):
                    logits = graphed(L.to(device), flat_mask.to(device), flat_tokens.to(device), flat_pos.to(device))
            else:
                step = _step(n, L.tolist(), flat_mask, max(n), int((L + count).max()), settings.mutant, device)
                logits = _forward(model, latent, step, flat_tokens, flat_pos, clock, device)
            target = torch.zeros(B, tokens.shape[1], dtype=torch.int32)
            starts = np.cumsum([0] + n)
            for b in range(B):
                target[b, :n[b]] = logits[starts[b]:starts[b + 1]].argmax(-1).to(torch.int32).cpu()
            with clock.stage("accept"):
                acc, acc_len, bonus = (t.cpu() for t in torch.ops.kdev.accept_greedy(
                    tokens.to(device), parents.to(device), count.to(device), target.to(device)))
            with clock.stage("compact"):
                moved = acc.clone()
                if settings.mutant == "compact-slot":
                    moved = torch.where(moved > 0, moved - 1, moved)  # a slot to the left of each accepted node's
                for pool in cache.pools:
                    torch.ops.kdev.compact_kv(pool, cache.page_table, L.to(device), moved.to(device),
                                              acc_len.to(device))
            for b in range(B):
                k = int(acc_len[b])
                new = tokens[b, acc[b, 1:k].long()].tolist() + [int(bonus[b])]
                emitted[b] += new
                emitted_round[b] += [r] * len(new)
                accepted_total += k - 1
            L = L + acc_len
            if progress:
                progress()
    finally:
        adapter.restore_attention(model, stock)
    seconds = dict(clock.seconds)
    seconds["rest of forward"] = seconds.pop("forward", 0.0) - latent.seconds
    seconds["verify attention"] = latent.seconds
    differences = compare(emitted, emitted_round, refs, reference)
    first = {d.prompt: d.position for d in differences}  # a prompt is compared up to its first difference
    compared = sum(first.get(b, len(emitted[b])) for b in range(B))
    rounds = B * settings.rounds
    return BudgetResult(budget, settings.page_size, settings.backend, settings.rounds, B, compared,
                        accepted_total / rounds, (accepted_total + rounds) / rounds, seconds, differences)


def _chain_mask(n: int, words: int | None = None) -> np.ndarray:
    from kdev import ddtree

    return ddtree.tree_mask_rows(ddtree.chain_tree(n, np.zeros(n, np.int64)), words or ddtree.mask_words(n))


def _step(sizes, prefix, mask, max_qlen, max_kv_len, mutant, device) -> adapter.VerifyStep:
    q_indptr = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int32)
    request = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    position = torch.cat([p + torch.arange(n) for p, n in zip(prefix, sizes)])
    return adapter.VerifyStep(q_indptr.to(device), torch.tensor(prefix, dtype=torch.int32).to(device),
                              mask.to(device), request.to(device), position.to(device), int(max_qlen),
                              int(max_kv_len) + 1, mutant)


def _forward(model, latent, step, tokens, positions, clock, device) -> torch.Tensor:
    latent.step = step
    with clock.stage("forward"):
        return _logits(model, tokens.to(device), positions.to(device))


def compare(emitted, emitted_round, refs, exact: bool) -> list[Difference]:
    """The first difference of each prompt (a later one would follow from it): failed, or excused where bf16 may
    flip the oracle's top-2 (never in float64)."""
    out = []
    for b, (got, ref) in enumerate(zip(emitted, refs)):
        for i, (g, w) in enumerate(zip(got, ref.tokens)):
            if g != w:
                gap = ref.gaps[i]
                excused = not exact and gap <= TIE_REL * max(abs(ref.tops[i]), 1.0)
                out.append(Difference(b, emitted_round[b][i], i, g, w, gap, excused))
                break
    return out


def run(settings: Settings, device: str = "cpu", progress=None, model=None, refs=None) -> list[BudgetResult]:
    """Every budget of settings on one model and one set of prompts, the references decoded once (by the stock model,
    on the same device) unless given."""
    model = model if model is not None else oracle.build_model()
    settings.check(model)
    if settings.graph and (torch.device(device).type != "cuda" or settings.backend == "reference"):
        raise BadInput("--graph: a kernel backend on --device cuda (the float64 reference reads lengths on the host)")
    prompts = prompts_for(settings, model.config.vocab_size)
    model = model.to(device)
    refs = refs if refs is not None else references(model, prompts, settings)
    try:
        return [run_budget(model, prompts, refs, settings, b, device, progress) for b in settings.budgets]
    finally:
        model.to("cpu")
