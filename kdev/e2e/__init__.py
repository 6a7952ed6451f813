"""The end-to-end check: tree speculative decoding on a small MLA model emits exactly what plain greedy decoding of the
same model emits, with kdev's kernels (or the float64 reference) in the loop.

The model is transformers' DeepSeek-V3 (oracle.py): its stock attention decodes the reference tokens; the speculative
path runs the same module with only the attention swapped for an absorbed-MLA adapter over a paged latent cache
(adapter.py); a drafter with a knob for how often it agrees with the target proposes per-depth top-k log-probs
(drafter.py); run.py drives draft -> DDTree build -> verify forward -> greedy accept -> KV compaction -> bonus token, and
compares. deploy.py turns a measured acceptance curve, the verify attention's bench times and a declared cost model of
the rest of a step into the budget curve of a real deploy. docs/e2e.md says what each proves and what it does not.
"""
