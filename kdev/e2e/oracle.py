"""The oracle: transformers' DeepseekV3ForCausalLM at a tiny size with the contract's attention dims (kv_lora_rank 512,
qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128), YaRN on and rope_interleave true as real checkpoints
have them, float64, weights from a seed with the LM head scaled so that logits are peaked; and its plain greedy
decoding (transformers' generate) as the reference tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdev import cabi
from kdev.errors import BadInput, EnvironmentMissing

# the attention dims kdev's kernels take (docs/architecture.md §2); DeepSeek-V3 and Kimi K2 have them
CONTRACT_DIMS = {"kv_lora_rank": cabi.LATENT_DIM, "qk_rope_head_dim": cabi.ROPE_DIM, "qk_nope_head_dim": 128,
                 "v_head_dim": 128}


@dataclass(frozen=True)
class TinyModel:
    """The oracle's size: few layers, heads, a small hidden size and vocabulary; the attention dims are the contract's.
    MLPs are dense (transformers' grouped MoE kernel takes no float64); attention is transformers' sdpa, which stays in
    float64 (its eager attention takes the softmax in float32)."""

    layers: int = 2
    heads: int = 4
    hidden: int = 128
    vocab: int = 256
    q_lora_rank: int = 64
    seed: int = 20261206
    logit_scale: float = 16.0  # the LM head's weights times this: top-2 logit gaps of O(1)
    yarn_factor: float = 4.0


def _transformers():
    try:
        import transformers
    except ImportError:
        raise EnvironmentMissing("the end-to-end check needs transformers (pip install 'kdev[e2e]')") from None
    return transformers


def tiny_config(spec: TinyModel = TinyModel()):
    t = _transformers()
    return t.DeepseekV3Config(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.hidden, moe_intermediate_size=spec.hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=spec.layers, q_lora_rank=spec.q_lora_rank, **CONTRACT_DIMS,
        max_position_embeddings=int(4096 * spec.yarn_factor), rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": spec.yarn_factor, "original_max_position_embeddings": 4096,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        rope_interleave=True, attn_implementation="sdpa", bos_token_id=None, eos_token_id=None, pad_token_id=None)


def check_config(cfg) -> None:
    """One line naming the first attention dim that is not the contract's."""
    for key, want in CONTRACT_DIMS.items():
        got = getattr(cfg, key, None)
        if got != want:
            raise BadInput(f"model config: {key} is {got}, kdev's kernels take {want} (DeepSeek-V3 / Kimi K2 MLA)")


def build_model(spec: TinyModel = TinyModel(), cfg=None):
    """The oracle model, float64 and in eval mode; the same spec gives the same weights on every machine."""
    t = _transformers()
    cfg = cfg if cfg is not None else tiny_config(spec)
    check_config(cfg)
    torch.manual_seed(spec.seed)
    model = t.DeepseekV3ForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(spec.logit_scale)
    return model


@dataclass
class Reference:
    """One prompt's greedy continuation and, at each generated position, the oracle's largest logit and its gap to the
    second."""

    tokens: list[int]
    tops: list[float]
    gaps: list[float]


def greedy(model, prompt: list[int], new_tokens: int) -> Reference:
    """Plain greedy decoding with the model's stock attention and cache (transformers' generate)."""
    ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
    with torch.no_grad():
        # the mask given: generate would take a prompt token equal to pad_token_id for padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, output_scores=True, return_dict_in_generate=True,
                             eos_token_id=None, pad_token_id=0)
    tops, gaps = [], []
    for s in out.scores:
        top = s[0].double().topk(2).values
        tops.append(float(top[0]))
        gaps.append(float(top[0] - top[1]))
    return Reference(out.sequences[0, len(prompt):].tolist(), tops, gaps)
