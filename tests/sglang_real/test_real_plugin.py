"""The `kdev` plugin in the real SGLang release: loaded through its `sglang.srt.plugins` entry point (pyproject.toml),
the documented launch line resolves in ServerArgs, SGLang's own page-size rule and kdev's refusals fire, and the factory
registered in the real registry builds the backend and DeepSeek's dispatch for the name."""

import json
import logging
import subprocess
import sys
import types

import pytest
import torch

from kdev.integrations.sglang import backend as kb
from kdev.integrations.sglang import plugin

from test_real_backend import Server, TritonVerifyFallback, one_rank  # noqa: F401 (a fixture)

from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A DeepSeek-V3-shaped config (MLA: kv_lora_rank 512, qk_rope_head_dim 64), no weights: ServerArgs reads only
    the config."""
    d = tmp_path_factory.mktemp("dsv3")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256,
        "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": 128,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "num_hidden_layers": 2,
        "intermediate_size": 512, "moe_intermediate_size": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "vocab_size": 1024, "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16", "rope_theta": 10000, "num_nextn_predict_layers": 1}))
    return str(d)


def launch_line(model_dir, *extra):
    """docs/integrations/sglang.md's launch line (less --tp and the GPU-only flags), on the CPU device."""
    return ["--model-path", model_dir, "--attention-backend", "kdev", "--speculative-algorithm", "EAGLE",
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16",
            "--speculative-draft-attention-backend", "triton", "--page-size", "1", "--device", "cpu", *extra]


def test_the_launch_line_resolves_with_the_plugin_loaded_through_its_entry_point(model_dir):
    load_plugins()  # what launch_server.py and cli/serve.py do before parsing
    view = resolved(launch_line(model_dir))
    assert view.attention_backend == "kdev" and view.page_size == 1
    assert view.speculative_draft_attention_backend == "triton" and view.speculative_eagle_topk == 4
    assert view.speculative_num_draft_tokens == 16
    # topk 1: SGLang resolves the node count to steps + 1 whatever the flag says (the backend reads each batch's own)
    chain = resolved(launch_line(model_dir, "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "8"))
    assert chain.speculative_num_draft_tokens == 4


def resolved(argv):
    """The launch's resolution, as launch_server.py runs it (prepare_server_args, then resolve_once)."""
    from sglang.srt.arg_groups.model_override_base import resolved_view

    args = prepare_server_args(argv)
    args.resolve_once()
    return resolved_view(args)


def test_without_the_plugin_sglang_refuses_the_name(model_dir):
    """SGLANG_PLUGINS names the plugins SGLang loads: without kdev's, the same line fails at parse time."""
    code = ("import sys; from sglang.srt.plugins import load_plugins; load_plugins(); "
            "from sglang.srt.server_args import prepare_server_args; prepare_server_args(sys.argv[1:])")
    r = subprocess.run([sys.executable, "-c", code, *launch_line(model_dir)], capture_output=True, text=True,
                       env={**__import__("os").environ, "SGLANG_PLUGINS": "not-kdev"}, timeout=300)
    assert r.returncode != 0 and "invalid choice: 'kdev'" in r.stderr


def test_sglangs_page_size_rule_refuses_a_tree_at_pages_over_one(model_dir):
    """arg_groups/speculative_hook.py: topk > 1 at page size > 1 only for flashinfer, fa3 and triton, so with kdev a
    tree runs at page size 1 (a chain, topk 1, takes any page size kdev takes)."""
    load_plugins()
    with pytest.raises(ValueError, match="page_size > 1 is only supported on.*attention_backend='kdev'"):
        resolved(launch_line(model_dir, "--page-size", "64"))
    chain = launch_line(model_dir, "--page-size", "64", "--speculative-eagle-topk", "1",
                        "--speculative-num-draft-tokens", "4")
    assert resolved(chain).page_size == 64


def test_the_plugin_never_raises_and_says_why_in_one_line(monkeypatch, caplog):
    def broken(*a, **k):
        raise RuntimeError("no registry here")

    monkeypatch.setattr(kb, "register", broken)
    with caplog.at_level(logging.ERROR, logger="kdev.sglang"):
        plugin.load()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "RuntimeError: no registry here" in lines[0] and "\n" not in lines[0]


def test_the_entry_point_module_imports_nothing_heavy():
    r = subprocess.run([sys.executable, "-c", "import sys, kdev.integrations.sglang.plugin; "
                        "print(sorted(m for m in ('torch', 'sglang', 'kdev.ops', 'kdev.abi') if m in sys.modules))"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def runner_for(server, **server_args):
    args = dict(speculative_algorithm="EAGLE", speculative_draft_attention_backend="triton",
                speculative_num_draft_tokens=16, dcp_size=1)
    args.update(server_args)
    return types.SimpleNamespace(use_mla_backend=True, page_size=server.page_size, is_draft_worker=False,
                                 req_to_token_pool=server.req_pool, token_to_kv_pool=server.pool,
                                 kv_cache_dtype=torch.bfloat16, model_config=types.SimpleNamespace(context_len=600),
                                 server_args=types.SimpleNamespace(**args))


def test_the_registered_factory_builds_the_backend_and_deepseeks_dispatch(seed):
    import numpy as np

    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    server = Server(np.random.default_rng(seed), page_size=1)
    register_attention_backend("kdev-test-fallback")(
        lambda runner: TritonVerifyFallback(runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token))
    load_plugins()
    assert "kdev" in ATTENTION_BACKENDS
    backend = kb.create(runner_for(server), "kdev-test-fallback")
    assert isinstance(backend.fallback, TritonVerifyFallback) and backend.kernel == kb.DEFAULT_KERNEL
    assert backend.max_draft == 16 and backend._pool() is server.pool
    handler = AttentionBackendRegistry.get_handler("kdev")
    verify = types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY)
    assert handler(None, verify) == AttnForwardMethod.MLA
    assert handler is not AttentionBackendRegistry.get_handler("no-such-name")  # not triton's default


@pytest.mark.parametrize("what, args, message", [
    ("draft backend", dict(speculative_draft_attention_backend=None), "--speculative-draft-attention-backend"),
    ("dcp", dict(dcp_size=2), "does not take --dcp-size 2"),
])
def test_kdevs_refusals_at_start_up(seed, what, args, message):
    import numpy as np

    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    server = Server(np.random.default_rng(seed), page_size=1)
    register_attention_backend("kdev-test-fallback")(
        lambda runner: TritonVerifyFallback(runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token))
    with pytest.raises(ValueError, match=message) as e:
        kb.create(runner_for(server, **args), "kdev-test-fallback")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="bf16 KV pool"):
        kb.create(types.SimpleNamespace(**{**vars(runner_for(server)), "kv_cache_dtype": torch.float8_e4m3fn}),
                  "kdev-test-fallback")
