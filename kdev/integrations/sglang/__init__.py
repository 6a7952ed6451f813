"""kdev's verify kernels in SGLang's MLA target-verify forward.

`convert` turns SGLang's verify inputs into kdev's contract (docs/architecture.md §2) and back: torch only, any device,
no SGLang needed, so they are tested in CI. `backend` is the attention backend that serves target-verify with kdev's
kernel and leaves every other mode to the server's own backend; `backend.register()` adds it to SGLang's registry
(docs/integrations/sglang.md). This package imports without SGLang installed.
"""

from kdev.integrations.sglang.convert import (ConversionError, check_positions, custom_mask_to_tree_mask,  # noqa: F401
                                              kv_indices_to_page_table, token_slots_to_page_table,
                                              tree_mask_to_custom_mask)
