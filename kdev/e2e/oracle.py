"""The oracle: transformers' DeepseekV3ForCausalLM at a tiny size with the contract's attention dims (kv_lora_rank 512,
qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128), Kimi K2's RoPE (theta 50,000, YaRN factor 32 over 4,096
positions, beta_fast = beta_slow = 1) and rope_interleave true as real checkpoints have them, 8 heads (Kimi K2.x's
per GPU at TP8), float64, weights from a seed; and its plain greedy decoding (transformers' generate) as the reference
tokens and logits.

Its rotary table is computed in float64 from kdev's YaRN frequencies (kdev/mla.py), after checking them against
transformers' own (float32) to float32 precision: transformers takes the table in float32, whose angles at position
5,000 are off by ~3e-4 rad, which no float64 comparison could see past. The rotation itself stays transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdev import cabi, mla
from kdev.config import ModelConfig, YarnConfig
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
    heads: int = 8
    hidden: int = 128
    vocab: int = 256
    q_lora_rank: int = 128
    seed: int = 20261206
    logit_scale: float = 16.0  # the LM head's weights times this: top-2 logit gaps of O(1)
    # Kimi K2's RoPE (configs/models/kimi-k2.yaml: moonshotai/Kimi-K2-Instruct's config.json)
    rope_theta: float = 50000.0
    yarn_factor: float = 32.0
    yarn_original: int = 4096
    beta_fast: float = 1.0
    beta_slow: float = 1.0
    planted: bool = True  # the attention circuits of plant() in the weights (False: transformers' random init)
    self_gain: tuple = (0.10, 0.11, 0.12, 0.13)  # the self heads' query . own key, by head
    prev: float = 3.3  # the previous-token heads' RoPE amplitude
    out_gain: float = 0.1  # attention outputs into S
    logit_gain: float = 3.0  # the LM head's read of S
    prev_read: float = 0.3  # the previous-token heads' share of it
    prev_heads: int = 2  # previous-token heads in each layer after the first (the other heads: self heads)


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
        max_position_embeddings=int(spec.yarn_original * spec.yarn_factor), rope_theta=spec.rope_theta,
        rope_scaling={"type": "yarn", "factor": spec.yarn_factor, "original_max_position_embeddings": spec.yarn_original,
                      "beta_fast": spec.beta_fast, "beta_slow": spec.beta_slow, "mscale": 1.0, "mscale_all_dim": 1.0},
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
    own = cfg is None
    cfg = cfg if cfg is not None else tiny_config(spec)
    check_config(cfg)
    torch.manual_seed(spec.seed)
    model = t.DeepseekV3ForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        if spec.planted and own:
            plant(model, spec)
        else:
            model.lm_head.weight.mul_(spec.logit_scale)
    use_float64_rope(model)
    return model


def plant(model, spec: TinyModel) -> None:
    """Weights that make every attention fault move the logits: a random model's attention barely matters (a 10 %
    softmax-scale error moved no logit by 0.07), so the circuits are built in, in the absorbed form's terms.

    The hidden state has two halves: T (dims 0..d/2) holds the token's embedding, with a constant component (dim 0)
    so that a token-independent RoPE query and key exist; S (d/2..d) holds what attention wrote. Every layer's
    queries, keys and values read T only and its outputs go to S only, so a layer's bf16 rounding does not reach a
    later layer's scores (where a dot product would add it up coherently and drown a 0.1 % fault), and the LM head
    reads S: the logits are what attention returned. Queries and latents are normalized (q_a_layernorm,
    kv_a_layernorm), so T's scale drops out. The latent c_kv = A x' with x' the token's own dims of T (not the
    constant one, which would put one common component in every value) and A [512, d/2 - 1] of orthonormal columns
    (spread over all 512 latent dims, as a checkpoint's are); W_UK and W_UV read x' back from it.
    - "self" heads (layer 0's, and those of later layers after the first prev_heads): score = self_gain[h] x_i . x_j: a node's weight on
      the keys of its own token is about half (~ln N above the rest), so the softmax scale, a dropped bit or a wrong
      row moves it. They take no RoPE term: its bf16 rounding alone moved the logits as much as a 0.1 % scale error.
    - previous-token heads (heads 0..prev_heads-1 of layers after the first): RoPE alone, peaked at i - j = 1 over the pairs
      Kimi's YaRN keeps at base frequency: a node reads its parent's row, and a wrong position, mask bit, slot or
      page makes it read another.
    - The LM head reads the self heads' output (through rotation Q0) under one fixed permutation of the vocabulary
      and the previous-token heads' (through Q1) under another: greedy decoding follows a seeded second-order chain
      that depends on what attention returns. MLPs are small and read and write T only.
    """
    g = torch.Generator().manual_seed(spec.seed + 1)
    d, V, H = spec.hidden, spec.vocab, spec.heads
    t = d // 2
    m = model.model
    f64 = torch.float64
    emb = torch.zeros(V, d, dtype=f64)
    emb[:, 1:t] = torch.randn(V, t - 1, generator=g, dtype=f64)
    emb[:, 1:t] *= (d - 30.25) ** 0.5 / emb[:, 1:t].norm(dim=-1, keepdim=True)  # one norm for every token: RMS 1
    emb[:, 0] = 5.5  # so RoPE's query and key have one amplitude whatever the token
    m.embed_tokens.weight.copy_(emb)
    u = t - 1  # the token's own dims (1..t-1): what the latent, the no-RoPE query and the values carry
    a = torch.linalg.qr(torch.randn(cabi.LATENT_DIM, u, generator=g, dtype=f64))[0]  # A^T A = I
    q0 = torch.linalg.qr(torch.randn(t, u, generator=g, dtype=f64))[0]
    q1 = torch.linalg.qr(torch.randn(t, u, generator=g, dtype=f64))[0]
    inv = mla.yarn_inv_freq(kdev_config(model.config))
    kept = int((inv > 1e-3).sum())  # pairs at (near) base frequency
    # the RoPE key: a random complex number per kept pair (random, so that bf16 rounds its dims independently);
    # the previous-token query: the key turned back by one position's angle, so q . k peaks at i - j = 1
    k_c = torch.polar(0.5 + torch.rand(kept, generator=g, dtype=f64), 2 * torch.pi * torch.rand(kept, generator=g,
                                                                                              dtype=f64))
    q_c = k_c * torch.polar(torch.ones(kept, dtype=f64), -inv[:kept])
    r_k, r_prev = torch.zeros(cabi.ROPE_DIM, dtype=f64), torch.zeros(cabi.ROPE_DIM, dtype=f64)
    r_k[0:2 * kept:2], r_k[1:2 * kept:2] = k_c.real, k_c.imag
    r_prev[0:2 * kept:2], r_prev[1:2 * kept:2] = q_c.real, q_c.imag
    e0 = torch.zeros(t, dtype=f64)
    e0[0] = 1.0
    for li, layer in enumerate(m.layers):
        at = layer.self_attn
        nope, rope, v = at.qk_nope_head_dim, at.qk_rope_head_dim, at.v_head_dim
        r = at.q_a_proj.weight.shape[0]
        at.q_a_proj.weight.zero_()
        at.q_a_proj.weight[:t, :t] = torch.eye(t, dtype=f64)  # x_T, then q_a_layernorm: |q_a|^2 = r
        qb = torch.zeros(H, nope + rope, r, dtype=f64)
        w_out = torch.zeros(d, H, v, dtype=f64)
        for h in range(H):
            if li > 0 and h < spec.prev_heads:
                qb[h, nope:, :t] = torch.outer(r_prev, e0) * spec.prev
                w_out[t:, h, :u] = q1
            else:
                qb[h, :u, 1:t] = torch.eye(u, dtype=f64) * spec.self_gain[h % len(spec.self_gain)]
                w_out[t:, h, :u] = q0
        at.q_b_proj.weight.copy_(qb.reshape(H * (nope + rope), r))
        kv = torch.zeros(cabi.QK_DIM, d, dtype=f64)
        kv[:cabi.LATENT_DIM, 1:t] = a
        kv[cabi.LATENT_DIM:, :t] = torch.outer(r_k, e0)
        at.kv_a_proj_with_mqa.weight.copy_(kv)
        kvb = torch.zeros(H, nope + v, cabi.LATENT_DIM, dtype=f64)
        kvb[:, :u] = a.T  # k_nope = A^T c_kv: the token's direction, |.| = sqrt(512)
        kvb[:, nope:nope + u] = a.T
        at.kv_b_proj.weight.copy_(kvb.reshape(-1, cabi.LATENT_DIM))
        at.o_proj.weight.copy_(w_out.reshape(d, H * v) * spec.out_gain / H)
        mlp = layer.mlp
        mlp.gate_proj.weight[:, t:] = 0.0
        mlp.up_proj.weight[:, t:] = 0.0
        mlp.down_proj.weight[t:] = 0.0
        for w in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            w.weight.mul_(0.1)
    p1 = torch.randperm(V, generator=g)
    p2 = torch.randperm(V, generator=g)
    xn = emb[:, 1:t] / emb[:, 1:t].norm(dim=-1, keepdim=True)  # each token's direction
    lm = torch.zeros(V, d, dtype=f64)
    lm[p1, t:] += xn @ q0.T  # the self heads' output
    if len(m.layers) > 1:
        lm[p2, t:] += spec.prev_read * xn @ q1.T  # the previous-token heads'
    model.lm_head.weight.copy_(lm * spec.logit_gain)


def kdev_config(cfg) -> ModelConfig:
    """kdev's model description (kdev/mla.py's RoPE, YaRN and softmax scale) of a transformers DeepSeek-V3 config."""
    rope = getattr(cfg, "rope_parameters", None) or cfg.rope_scaling
    yarn = YarnConfig(float(rope["factor"]), int(rope["original_max_position_embeddings"]), float(rope["mscale"]),
                      float(rope["mscale_all_dim"]), float(rope["beta_fast"]), float(rope["beta_slow"]))
    return ModelConfig("e2e-oracle", cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                       cfg.qk_rope_head_dim, cfg.v_head_dim, float(rope["rope_theta"] if "rope_theta" in rope else cfg.rope_theta), yarn)


def rope_agreement(model) -> dict:
    """kdev's YaRN against transformers': the largest relative difference of the inverse frequencies (transformers'
    are float32), the cos/sin factor and the softmax scale of every layer."""
    kcfg = kdev_config(model.config)
    rot = model.model.rotary_emb
    theirs = getattr(rot, "transformers_inv_freq", rot.inv_freq).double().cpu()
    ours = mla.yarn_inv_freq(kcfg)
    return {"inv_freq_rel": float(((ours - theirs).abs() / theirs).max()),
            "mscale": (mla.yarn_rope_mscale(kcfg), float(rot.attention_scaling)),
            "softmax_scale": (kcfg.softmax_scale, [float(layer.self_attn.scaling) for layer in model.model.layers])}


def use_float64_rope(model) -> None:
    """The model's rotary table in float64 from kdev's YaRN frequencies, refused unless they are transformers' to float32
    precision (and the cos/sin factor and every layer's softmax scale are equal)."""
    rot = model.model.rotary_emb
    agree = rope_agreement(model)
    m_ours, m_theirs = agree["mscale"]
    s_ours, s_theirs = agree["softmax_scale"]
    if agree["inv_freq_rel"] > 2.0**-20 or abs(m_ours - m_theirs) > 1e-12 or any(
            abs(s - s_ours) > 1e-12 * s_ours for s in s_theirs):
        raise BadInput(f"kdev's YaRN is not transformers': {agree}")
    rot.transformers_inv_freq = rot.inv_freq.clone()
    rot.inv_freq = mla.yarn_inv_freq(kdev_config(model.config)).to(rot.inv_freq.device)

    def forward(x, position_ids):
        freqs = position_ids[..., None].double() * rot.inv_freq.to(device=x.device, dtype=torch.float64)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * rot.attention_scaling).to(x.dtype), (emb.sin() * rot.attention_scaling).to(x.dtype)

    rot.forward = forward


@dataclass
class Reference:
    """One prompt's greedy continuation and the oracle's logits [n, vocab] (float64) at each generated position."""

    tokens: list[int]
    logits: torch.Tensor

    def gap(self, i: int) -> float:
        top = self.logits[i].topk(2).values
        return float(top[0] - top[1])


def greedy(model, prompt: list[int], new_tokens: int, offset: int = 0) -> Reference:
    """Plain greedy decoding with the model's stock attention and its own cache (transformers' forward with
    past_key_values, one token at a time; generate would hand its logits back in float32). Token i sits at RoPE
    position offset + i."""
    dev = model.device
    ids = torch.tensor([prompt], dtype=torch.long, device=dev)
    tokens, logits = [], []
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=offset + torch.arange(len(prompt), device=dev)[None], use_cache=True)
        for k in range(new_tokens):
            last = out.logits[0, -1].double()
            logits.append(last.cpu())
            tokens.append(int(last.argmax()))
            if k + 1 < new_tokens:
                name = "cache" if "cache" in out else "past_key_values"  # transformers 5 renamed it
                out = model(input_ids=torch.tensor([[tokens[-1]]], device=dev), **{name: out[name]},
                            position_ids=torch.tensor([[offset + len(prompt) + k]], device=dev), use_cache=True)
    return Reference(tokens, torch.stack(logits))
