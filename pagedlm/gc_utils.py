"""Garbage-collector settings of the engine and worker processes (as vLLM's EngineCore)."""

from __future__ import annotations

import atexit
import gc

from pagedlm.utils import trim_malloc_heap


def freeze_gc_heap() -> None:
    """Collect, then move every tracked object into the permanent generation: the model, the
    KV cache and the engine's startup objects are never traversed again by the collections
    that a step's many small allocations trigger (about 1% of a decode-heavy run otherwise).
    Objects frozen here are still freed by reference counting; `gc.unfreeze()` at shutdown
    gives cyclic garbage among them back to the collector, as an exit handler does at exit
    (extension modules such as triton's report frozen objects as leaks otherwise). What
    startup freed goes back to the system (`trim_malloc_heap`)."""
    gc.collect()
    trim_malloc_heap()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # registered once
    atexit.register(gc.unfreeze)
