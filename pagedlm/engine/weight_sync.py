"""The engine's view of the workers' weights: their version, and the prefix cache they made.

Invariants:
- a worker that commits new weights (by any path: weight transfer, `load_weights` on the
  model, `collective_rpc`) tells the executor (`take_weights_changed`); before the next step
  the prefix cache is invalidated, so no request reuses KV computed with other weights.
  Running requests keep their KV and go on.
- after `sleep(level=2)` and `wake_up`, the next step first asks the workers whether every
  discarded weight was loaded again (and raises until it was).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedlm.core.kv_cache_manager import KVCacheManager
    from pagedlm.executor.abstract import Executor

logger = logging.getLogger(__name__)


class WeightSync:
    def __init__(self, executor: Executor, kv_cache_manager: KVCacheManager) -> None:
        self.executor = executor
        self.kv_cache_manager = kv_cache_manager
        self.weight_version: str | None = None
        self._presence_unchecked = False

    def expect_reloaded_weights(self) -> None:
        """Weights were discarded and woken: check they are all back before the next step."""
        self._presence_unchecked = True

    def before_step(self) -> None:
        if self.executor.take_weights_changed():
            self.kv_cache_manager.invalidate_prefix_cache()
            logger.info("Weights changed: prefix cache invalidated")
        self.check_weights_present()

    def check_weights_present(self) -> None:
        """After sleep(level=2): raise until every discarded weight was loaded again."""
        if self._presence_unchecked:
            self.executor.collective_rpc("check_weights_present")
            self._presence_unchecked = False
