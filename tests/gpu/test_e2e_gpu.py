"""The end-to-end check on a GPU with kdev's bf16 kernels in the loop (the engine calls, flash and flash-portable, and
the DDTree build, accept and compaction kernels): the default matrix of `kdev e2e` (pages of 64 and 1, trees of 17, 65
and 257 nodes, chunked prefill, RoPE past 4,096), eagerly and as replayed CUDA graphs, judged by the command's own
verdict (docs/e2e.md: the logits within the bf16 bound at every accepted and bonus position); the unfaulted run
passes and a softmax scale x 1.001 fails it; the stage times are reported."""

from dataclasses import replace

import pytest

pytest.importorskip("transformers")

from kdev import registry  # noqa: E402
from kdev.e2e import run  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kernel,graph", [(k, g) for k in registry.ENGINE for g in (False, True)])
def test_kernels_in_the_loop_pass_the_verdict(kernel, graph):
    cases = [replace(c, graph=graph) for c in run.matrix((kernel,))]
    results = run.run_matrix(cases, device="cuda")
    for r in results:
        assert r.passed, ([d.to_dict() for d in r.differences], [p.to_dict() for p in r.failed_positions])
        assert r.compared > 0 and r.seconds["tree build"] > 0 and r.seconds["compact"] > 0
        assert r.seconds["verify forward (graph)"] > 0 if graph else r.seconds["verify attention"] > 0
        print(f"{kernel}{' graph' if graph else ''} {r.case} budget {r.budget}: worst {r.worst:.3g} of the bound, "
              f"{len(r.excused)} excused, {r.tokens_per_round:.2f} tokens/round, "
              f"{ {k: round(1e3 * v / r.rounds, 2) for k, v in r.seconds.items()} } ms per round")


@pytest.mark.parametrize("kernel", registry.ENGINE)
def test_a_planted_scale_fault_fails_with_the_kernels(kernel):
    results = run.run_matrix(run.matrix((kernel,), mutant="scale")[:1], device="cuda")
    assert not any(r.passed for r in results)
