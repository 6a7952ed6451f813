"""Tree speculative decoding against plain greedy decoding, logits against logits (kdev e2e).

Per batch of prompts and node budget: prefill (each prompt as chains through the adapter, in chunks), then rounds of
draft -> DDTree build (torch.ops.kdev.build_ddtree) -> one verify forward over every tree -> greedy accept
(torch.ops.kdev.accept_greedy) -> KV compaction (torch.ops.kdev.compact_kv) -> the bonus token as the next root. On
CUDA the ops are kdev's kernels; on the CPU their references. At every accepted and bonus position the verify
forward's logits are compared with the oracle's (verdict.py: the bound of each precision, near-ties excused and
teacher-forced), and the accept walk and emitted tokens with the oracle's tokens.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from kdev import cabi, ops  # noqa: F401  (ops: importing it registers torch.ops.kdev)
from kdev.e2e import adapter, oracle, verdict
from kdev.e2e.drafter import OracleDrafter
from kdev.errors import BadInput

# planted faults (the tests show each caught): the attention's (adapter.py) and the tree ops': compaction from the slot
# to the left of each accepted node's, from a sibling's slot, and the bonus token taken from the last accepted node's
# parent
MUTANTS = (*adapter.MUTANTS, "compact-slot", "sibling-compact", "bonus-parent")


@dataclass
class Difference:
    """An emitted token (or accept walk) that is not the oracle's where the logits said it would be."""

    prompt: int
    round: int  # 0: the prefill's token
    position: int  # index among the generated tokens
    got: int
    want: int
    what: str

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
    differences: list = field(default_factory=list)  # emitted tokens or walks that are not the oracle's
    case: str = ""  # Settings.label()
    compared: int = 0  # positions whose logits were compared
    worst: float = 0.0  # the largest error / bound over them
    positions: list = field(default_factory=list)  # the excused and the failing ones (verdict.Position)
    max_position: int = 0  # the largest RoPE position reached
    max_nodes: int = 0  # the largest tree (nodes, root included)
    prefill_chunks: int = 0  # the most chunks a prompt was prefilled in

    @property
    def failed_positions(self) -> list:
        return [p for p in self.positions if p.status == "fails"]

    @property
    def excused(self) -> list:
        return [p for p in self.positions if p.status == "excused"]

    @property
    def passed(self) -> bool:
        return not self.differences and not self.failed_positions and self.compared > 0

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["differences"] = [x.to_dict() for x in self.differences]
        d["positions"] = [x.to_dict() for x in self.positions]
        d["excused"], d["failed"] = len(self.excused), len(self.failed_positions)
        d["passed"] = self.passed
        return d


@dataclass(frozen=True)
class Settings:
    prompts: int = 3
    rounds: int = 5
    budgets: tuple = (16, 64, 256)
    page_size: int = 64
    backend: str = "reference"
    depth: int = 8
    topk: int = 4
    agree: float = 0.7
    min_prompt: int = 130  # 130..200 tokens: 3 and 4 pages of 64 once the rounds are in
    max_prompt: int = 200
    seed: int = 0
    mutant: str | None = None
    graph: bool = False  # each budget's verify forward captured in a CUDA graph and replayed (CUDA only)
    prefill_chunk: int = 64  # prompt tokens per prefill forward (a chain of at most MAX_QLEN rows)
    kdev_rope: bool = True  # kdev's apply_rope and YaRN in the adapter (False: transformers' rotation, its cos/sin)
    position_offset: int = 0  # added to every RoPE position, the oracle's too (positions past 4,096 on a short cache)
    heads: int = 8  # the oracle's heads (8: Kimi K2.x's per GPU at TP8; 64: attention DP's)

    def label(self) -> str:
        return (f"{self.backend}, page {self.page_size}, {self.heads} heads, prompts {self.min_prompt}..{self.max_prompt}"
                + (f" at RoPE +{self.position_offset}" if self.position_offset else ""))

    def check(self, model) -> None:
        """One line for the first bad setting; `model`: the model or its transformers config."""
        cfg = getattr(model, "config", model)
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
        longest = self.position_offset + self.max_prompt + 1 + self.rounds * (self.depth + 1) + self.depth
        if longest > cfg.max_position_embeddings:
            raise BadInput(f"a prompt of {self.max_prompt} tokens and {self.rounds} rounds reach position {longest}, "
                           f"past the model's {cfg.max_position_embeddings}")
        if self.backend not in adapter.BACKENDS:
            raise BadInput(f"--backend {self.backend!r}: one of {', '.join(adapter.BACKENDS)}")
        if not 0.0 <= self.agree <= 1.0:
            raise BadInput(f"--agree {self.agree}: between 0 and 1")
        if self.graph and self.backend in ("reference", adapter.EMULATED):
            raise BadInput(f"--graph: a kernel backend on --device cuda, not {self.backend} (it reads lengths on the "
                           "host)")
        if self.mutant is not None and self.mutant not in MUTANTS:
            raise BadInput(f"mutant {self.mutant!r}: one of {', '.join(MUTANTS)}")


def prompts_for(settings: Settings, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(settings.seed)
    lens = rng.integers(settings.min_prompt, settings.max_prompt + 1, settings.prompts)
    return [rng.integers(0, vocab, int(n)).tolist() for n in lens]


def references(model, prompts: list[list[int]], settings: Settings, progress=None) -> list[oracle.Reference]:
    """Enough greedy tokens for every round to accept its whole depth, and the drafter's look-ahead past it."""
    n = 1 + settings.rounds * (settings.depth + 1) + settings.depth
    out = []
    for i, p in enumerate(prompts):
        out.append(oracle.greedy(model, p, n, settings.position_offset))
        if progress:
            progress(f"oracle's greedy decoding, prompt {i + 1}")
    return out


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


def _logits(model, tokens: torch.Tensor, positions: torch.Tensor, latent=None) -> torch.Tensor:
    """The model's own modules in its order (embedding, rotary table, decoder layers, norm, LM head), without the
    causal mask the model would build for its stock attention: the adapter takes the tree mask, and the mask's host
    checks could not be captured in a CUDA graph. The final norm's 1 / rms per row goes to latent.inv_rms (the bf16
    bound reads it)."""
    m = model.model
    with torch.no_grad():
        hidden = m.embed_tokens(tokens[None])
        pos = positions[None]
        emb = m.rotary_emb(hidden, pos)
        for layer in m.layers:
            hidden = layer(hidden, attention_mask=None, position_ids=pos, position_embeddings=emb)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        if latent is not None:
            h = hidden[0].double()
            latent.inv_rms = torch.rsqrt(h.square().mean(-1) + m.norm.variance_epsilon)
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
            nodes, bound, mutant, self.positions)

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
                _logits(self.model, self.tokens, self.positions, self.latent)  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = _logits(self.model, self.tokens, self.positions, self.latent)
        self.latent.timed = True
        self.graph.replay()
        return self.out


class _Judge:
    """Compares the verify forward's logits at a batch of rows with the oracle's (verdict.py) and keeps the record."""

    def __init__(self, model, refs, bf16: bool):
        self.refs, self.bounds = refs, verdict.Bounds(model, bf16)
        self.compared, self.worst, self.positions = 0, 0.0, []

    def rows(self, logits, latent, rows: list, where: list) -> None:
        """rows: indices into the forward's rows; where: (prompt, round, generated index) of each."""
        if not rows:
            return
        idx = torch.tensor(rows, device=logits.device)
        got = logits[idx].double().cpu()
        want = torch.stack([self.refs[b].logits[i] for b, _, i in where])
        outs = [latent.outputs[k][idx] for k in sorted(latent.outputs)]
        bound = self.bounds.of(want, outs, latent.inv_rms[idx])
        for j, (b, r, i) in enumerate(where):
            ratio, err, bnd, arg, status = verdict.judge(got[j], want[j], bound[j], self.refs[b].tokens[i])
            self.compared += 1
            self.worst = max(self.worst, ratio)
            if status != "ok":
                gap = self.refs[b].gap(i)
                why = (f"argmax {arg}, the oracle's {self.refs[b].tokens[i]}: a near-tie (top-2 gap {gap:.3g}), logits "
                       f"within the bound (error {err:.3g} <= {bnd:.3g}); the oracle's token taken"
                       if status == "excused" else f"error {err:.3g} > bound {bnd:.3g} ({ratio:.3g} x)")
                self.positions.append(verdict.Position(b, r, i, ratio, err, bnd, arg, self.refs[b].tokens[i], gap,
                                                       status, why))


def run_budget(model, prompts, refs, settings: Settings, budget: int, device="cpu", progress=None) -> BudgetResult:
    """One budget: prefill, settings.rounds rounds, the comparison at every accepted and bonus position."""
    B, D = len(prompts), settings.depth
    reference = settings.backend == "reference"
    dtype = torch.float64 if reference else torch.bfloat16
    max_len = max(map(len, prompts)) + 2 + settings.rounds * (D + 1) + budget + 1
    cache = adapter.PagedLatentCache(len(model.model.layers), B, max_len, settings.page_size, dtype, device,
                                     settings.seed + 1)
    clock = _Clock(device)
    # kdev's RoPE builds its YaRN table on the host each call, which a CUDA graph cannot capture: --graph rotates with
    # transformers' function and the model's (float64) cos/sin
    rope = oracle.kdev_config(model.config) if settings.kdev_rope and not settings.graph else None
    latent = adapter.LatentAttention(cache, settings.backend, clock.sync, rope)
    drafter = OracleDrafter(D, settings.topk, model.config.vocab_size, settings.agree, settings.seed + 2)
    judge = _Judge(model, refs, not reference)
    stock = adapter.swap_attention(model, latent)
    emitted: list[list[int]] = [[] for _ in range(B)]
    differences: list[Difference] = []
    accepted_total = max_pos = max_nodes = chunks = 0
    graphed = None
    try:
        # prefill: each prompt as chains of up to prefill_chunk tokens, each after the chunks before it (a prompt
        # already done takes no rows); the logits at a prompt's last position give the first generated token
        lens = [len(p) for p in prompts]
        done = [0] * B
        while any(d < n for d, n in zip(done, lens)):
            chunks += 1
            sizes = [min(settings.prefill_chunk, n - d) for d, n in zip(done, lens)]
            words = max(1, (max(sizes) + 63) // 64)  # one mask width for the batch
            mask = torch.from_numpy(np.concatenate([_chain_mask(t, words) for t in sizes]).view(np.int64))
            step = _step(sizes, done, mask, max(sizes), max(d + t for d, t in zip(done, sizes)), settings.mutant,
                         device, offset=settings.position_offset)
            tokens = torch.tensor(sum((p[d:d + t] for p, d, t in zip(prompts, done, sizes)), []))
            logits = _forward(model, latent, step, tokens, settings.position_offset + torch.cat(
                [d + torch.arange(t) for d, t in zip(done, sizes)]), clock, device)
            ends = np.cumsum(sizes) - 1
            rows, where = [], []
            for b in range(B):
                done[b] += sizes[b]
                if sizes[b] and done[b] == lens[b]:
                    rows.append(int(ends[b]))
                    where.append((b, 0, 0))
                    emitted[b].append(refs[b].tokens[0])  # teacher-forced: the logits are what is judged
            with clock.stage("compare"):
                judge.rows(logits, latent, rows, where)
        if progress:
            progress("prefill")
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
            max_nodes = max(max_nodes, *n)
            flat_tokens = torch.cat([tokens[b, :n[b]] for b in range(B)]).long()
            flat_pos = torch.cat([positions[b, :n[b]] for b in range(B)]).long()
            flat_mask = torch.cat([masks[b, :n[b]] for b in range(B)])
            max_pos = max(max_pos, int(flat_pos.max()) + settings.position_offset)
            if settings.graph:
                if set(n) != {budget + 1}:
                    raise BadInput(f"--graph: a tree of {min(n)} nodes, not budget + 1: the drafter's depth x top-k "
                                   "cannot fill the budget")
                graphed = graphed or _GraphedVerify(model, latent, B, budget + 1, max_len, settings.mutant, device)
                with clock.stage("verify forward (graph)"):
                    logits = graphed(L.to(device), flat_mask.to(device), flat_tokens.to(device),
                                     (flat_pos + settings.position_offset).to(device))
            else:
                step = _step(n, L.tolist(), flat_mask, max(n), int((L + count).max()), settings.mutant, device,
                             flat_pos, settings.position_offset)
                logits = _forward(model, latent, step, flat_tokens, flat_pos + settings.position_offset, clock, device)
            # the accepted path, teacher-forced onto the oracle's tokens: from the root, the child whose token is the
            # oracle's next one; its logits are compared (a near-tie takes the oracle's token, a failure is recorded)
            target = torch.zeros(B, tokens.shape[1], dtype=torch.int32)
            starts = np.cumsum([0] + n)
            rows, where, paths = [], [], []
            for b in range(B):
                target[b, :n[b]] = logits[starts[b]:starts[b + 1]].argmax(-1).to(torch.int32).cpu()
                g0, node, path = len(emitted[b]), 0, []
                children: dict = {}
                for i in range(1, n[b]):
                    children.setdefault(int(parents[b, i]), []).append(i)
                while True:
                    want = refs[b].tokens[g0 + len(path)]
                    path.append(node)
                    rows.append(int(starts[b]) + node)
                    where.append((b, r, g0 + len(path) - 1))
                    target[b, node] = want
                    node = next((c for c in children.get(node, ()) if int(tokens[b, c]) == want), None)
                    if node is None:
                        break
                paths.append(path)
            with clock.stage("compare"):
                judge.rows(logits, latent, rows, where)
            with clock.stage("accept"):
                acc, acc_len, bonus = (t.cpu() for t in torch.ops.kdev.accept_greedy(
                    tokens.to(device), parents.to(device), count.to(device), target.to(device)))
            if settings.mutant == "bonus-parent":  # the bonus token from the last accepted node's parent
                for b in range(B):
                    k = int(acc_len[b])
                    if k > 1:
                        bonus[b] = target[b, int(parents[b, int(acc[b, k - 1])])]
            with clock.stage("compact"):
                moved = acc.clone()
                if settings.mutant == "compact-slot":
                    moved = torch.where(moved > 0, moved - 1, moved)  # a slot to the left of each accepted node's
                if settings.mutant == "sibling-compact":  # an accepted node's sibling's row where it has one
                    for b in range(B):
                        for j in range(1, int(acc_len[b])):
                            node = int(acc[b, j])
                            sib = [i for i in range(1, n[b]) if i != node and int(parents[b, i]) == int(parents[b, node])]
                            if sib:
                                moved[b, j] = sib[0]
                for pool in cache.pools:
                    torch.ops.kdev.compact_kv(pool, cache.page_table, L.to(device), moved.to(device),
                                              acc_len.to(device))
            for b in range(B):
                k, g0 = int(acc_len[b]), len(emitted[b])
                walk = acc[b, :k].tolist()
                new = tokens[b, acc[b, 1:k].long()].tolist() + [int(bonus[b])]
                if walk != paths[b]:
                    differences.append(Difference(b, r, g0, -1, -1, f"accept walk {walk}, the oracle's {paths[b]}"))
                for j, tok in enumerate(new):
                    if tok != refs[b].tokens[g0 + j]:
                        what = "bonus token" if j == len(new) - 1 else "accepted token"
                        differences.append(Difference(b, r, g0 + j, tok, refs[b].tokens[g0 + j], what))
                        break
                emitted[b] += new
                accepted_total += k - 1
            L = L + acc_len
            if progress:
                progress(f"budget {budget} round {r}")
    finally:
        adapter.restore_attention(model, stock)
    seconds = dict(clock.seconds)
    seconds["rest of forward"] = seconds.pop("forward", 0.0) - latent.seconds
    seconds["verify attention"] = latent.seconds
    rounds = B * settings.rounds
    return BudgetResult(budget, settings.page_size, settings.backend, settings.rounds, B, sum(map(len, emitted)),
                        accepted_total / rounds, (accepted_total + rounds) / rounds, seconds, differences,
                        settings.label(), judge.compared, judge.worst, judge.positions, max_pos, max_nodes, chunks)


def _chain_mask(n: int, words: int | None = None) -> np.ndarray:
    from kdev import ddtree

    return ddtree.tree_mask_rows(ddtree.chain_tree(n, np.zeros(n, np.int64)), words or ddtree.mask_words(n))


def _step(sizes, prefix, mask, max_qlen, max_kv_len, mutant, device, rope_position=None,
          offset: int = 0) -> adapter.VerifyStep:
    q_indptr = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int32)
    request = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    position = torch.cat([p + torch.arange(n) for p, n in zip(prefix, sizes)])
    return adapter.VerifyStep(q_indptr.to(device), torch.tensor(prefix, dtype=torch.int32).to(device),
                              mask.to(device), request.to(device), position.to(device), int(max_qlen),
                              int(max_kv_len) + 1, mutant,
                              None if rope_position is None else rope_position.to(device), offset)


def _forward(model, latent, step, tokens, positions, clock, device) -> torch.Tensor:
    latent.step = step
    with clock.stage("forward"):
        return _logits(model, tokens.to(device), positions.to(device), latent)


def _kernels_on(device: str) -> None:
    """On CUDA, the library the ops run: this GPU's, built first where need be (kdev e2e is a command; the ops alone,
    a server's path, never start nvcc)."""
    if torch.device(device).type == "cuda":
        from kdev import abi

        ops.use_library(abi.load_library())


def run(settings: Settings, device: str = "cpu", progress=None, model=None, refs=None) -> list[BudgetResult]:
    """Every budget of settings on one model and one set of prompts, the references decoded once (by the stock model,
    on the same device) unless given."""
    _kernels_on(device)
    model = model if model is not None else oracle.build_model(oracle.TinyModel(heads=settings.heads))
    settings.check(model)
    if settings.graph and (torch.device(device).type != "cuda" or settings.backend in ("reference", adapter.EMULATED)):
        raise BadInput("--graph: a kernel backend on --device cuda (the float64 reference and the bf16 emulation read "
                       "lengths on the host)")
    prompts = prompts_for(settings, model.config.vocab_size)
    model = model.to(device)
    try:
        refs = refs if refs is not None else references(model, prompts, settings, progress)
        return [run_budget(model, prompts, refs, settings, b, device, progress) for b in settings.budgets]
    finally:
        model.to("cpu")


# the default matrix (docs/e2e.md): >= 3 pages of 64 and a run at page size 1, trees of 17, 65 and 257 nodes (1, 2
# and 5 mask words), prompts prefilled in chunks of 64, 8 heads, RoPE positions past 4,096 with Kimi K2's YaRN
DEFAULT_CASES = (Settings(), Settings(budgets=(64,), page_size=1, seed=1),
                 Settings(prompts=2, budgets=(64,), position_offset=5000, seed=2))
# the fuller matrix (--full): budgets 1..512, pages of 16, a real 4K+ prefix (chunks of 1,024), 64 heads
FULL_CASES = DEFAULT_CASES + (
    Settings(budgets=(1, 2, 4, 8, 32, 128, 512), seed=3, rounds=4),
    Settings(budgets=(16, 256), page_size=16, seed=4),
    Settings(prompts=1, rounds=3, budgets=(64,), min_prompt=4200, max_prompt=4300, prefill_chunk=1024, seed=5),
    Settings(prompts=2, rounds=3, budgets=(64,), heads=64, seed=6),
)


def matrix(backends: tuple, full: bool = False, **overrides) -> list[Settings]:
    """Every case of the default (or fuller) matrix for every backend, with `overrides` (Settings fields) applied."""
    cases = FULL_CASES if full else DEFAULT_CASES
    return [replace(c, backend=b, **overrides) for c in cases for b in backends]


def work(cases: list[Settings]) -> int:
    """Progress steps of run_matrix: one per reference decode, prefill and round."""
    keys = {_refs_key(c): c.prompts for c in cases}
    return sum(keys.values()) + sum(len(c.budgets) * (c.rounds + 1) for c in cases)


def _refs_key(c: Settings) -> tuple:
    return (c.heads, c.prompts, c.seed, c.min_prompt, c.max_prompt, c.rounds, c.depth, c.position_offset)


def run_matrix(cases: list[Settings], device: str = "cpu", progress=None, models: dict | None = None
               ) -> list[BudgetResult]:
    """Every case, one model per head count (kept in `models` where given) and one reference decode per set of
    prompts (shared by the backends)."""
    for c in cases:  # every case's settings before any model is built
        c.check(oracle.tiny_config(oracle.TinyModel(heads=c.heads)))
    _kernels_on(device)
    models = {} if models is None else models
    refs: dict = {}
    for c in cases:
        if c.heads not in models:
            models[c.heads] = oracle.build_model(oracle.TinyModel(heads=c.heads))
    out = []
    for c in cases:
        model = models[c.heads]
        key = _refs_key(c)
        if key not in refs:
            model.to(device)
            try:
                refs[key] = references(model, prompts_for(c, model.config.vocab_size), c, progress)
            finally:
                model.to("cpu")
        out += run(c, device, progress, model, refs[key])
    return out
