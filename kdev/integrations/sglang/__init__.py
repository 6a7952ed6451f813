"""kdev's verify kernels in SGLang's MLA target-verify forward.

`convert` turns SGLang's verify inputs into kdev's contract (docs/architecture.md §2) and back: torch only, any device,
no SGLang needed. `backend` is the attention backend that serves target-verify with kdev's kernel and leaves every
other mode to the server's own backend; `plugin` is SGLang's entry point that registers it (`--attention-backend kdev`,
docs/integrations/sglang.md). This package imports without SGLang installed, and without torch until a name of
`convert` is read (the plugin entry point loads through it).
"""

import importlib

# The SGLang release the backend is written and tested against (tests/sglang_real/ installs it; a test there fails,
# naming what to re-check, when another is installed).
SGLANG_RELEASE = "0.5.23"

_CONVERT_NAMES = ("ConversionError", "check_positions", "custom_mask_to_tree_mask", "kv_indices_to_page_table",
                  "token_slots_to_page_table", "tree_mask_to_custom_mask")


def __getattr__(name):
    if name in _CONVERT_NAMES:
        return getattr(importlib.import_module("kdev.integrations.sglang.convert"), name)
    raise AttributeError(name)
