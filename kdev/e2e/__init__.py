"""The end-to-end check: tree speculative decoding on a small MLA model reproduces plain greedy decoding of the same
model to its logits, with kdev's kernels (or the float64 reference, or their bf16 arithmetic emulated) in the loop.

The model is transformers' DeepSeek-V3 (oracle.py), its weights planted so that attention faults move the logits: its
stock attention decodes the reference tokens and logits; the speculative path runs the same module with only the
attention swapped for an absorbed-MLA adapter over a paged latent cache, RoPE by kdev's own YaRN (adapter.py); a
drafter with a knob for how often it agrees with the target proposes per-depth top-k log-probs (drafter.py); run.py
drives draft -> DDTree build -> verify forward -> greedy accept -> KV compaction -> bonus token over a matrix of cases,
and verdict.py judges the logits at every accepted and bonus position within each precision's bound. deploy.py turns
an acceptance curve, the verify attention (a bench result or kdev plan's projection) and a declared cost model of the
rest of a step into the budget curve of a real deploy, a projection with its range. docs/e2e.md says what each proves
and what it does not.
"""
