"""Tests of kdev's SGLang backend against the real SGLang release (kdev.integrations.sglang.SGLANG_RELEASE).

They run in their own virtual environment and process (tests/sglang_real/run.sh, called by .ci/run): SGLang pins its
own torch and transformers, and importing it patches transformers, which the main suite's end-to-end tests use. The
main run (`python -m pytest`) collects nothing here; run.sh sets KDEV_SGLANG_REAL=1, and there an import that fails is
a failure, not a skip.
"""

import os

if not os.environ.get("KDEV_SGLANG_REAL"):
    collect_ignore_glob = ["test_*.py"]
