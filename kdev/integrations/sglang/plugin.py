"""SGLang's plugin entry point for kdev (pyproject.toml: [project.entry-points."sglang.srt.plugins"] kdev).

SGLang 0.5.23 loads the `sglang.srt.plugins` entry points before it parses the command line (launch_server.py,
cli/serve.py) and again in every scheduler process (managers/scheduler.py), so `--attention-backend kdev` is accepted
with no launcher script. SGLang logs a plugin's exception and goes on, and the user would then see only "invalid
choice: 'kdev'": `load` therefore never raises, and says in one line why `kdev` could not be registered. Importing this
module imports nothing but the standard library; `load` imports the backend (torch, kdev's binding; no GPU work).
"""

from __future__ import annotations

import logging

log = logging.getLogger("kdev.sglang")


def load() -> None:
    """Register the `kdev` attention backend (backend.register: $KDEV_SGLANG_FALLBACK, $KDEV_SGLANG_KERNEL)."""
    try:
        from kdev.integrations.sglang import backend

        backend.register()
    except Exception as e:  # noqa: BLE001 -- a plugin must not raise into SGLang's loader (module docstring)
        log.error("kdev: the 'kdev' attention backend was not registered (%s: %s); --attention-backend kdev will be "
                  "refused", type(e).__name__, e)
