"""Adapters that put kdev's kernels where they are served (kdev/integrations/sglang: SGLang's MLA target-verify)."""
