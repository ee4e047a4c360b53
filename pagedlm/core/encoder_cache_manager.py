"""Which images' encoder outputs the workers hold (vLLM v1's EncoderCacheManager).

The scheduler decides, as it schedules a request's tokens, which of its images must be
encoded this step: an image whose placeholder tokens overlap the step's tokens and whose output
is not cached. Outputs are cached on the workers by the image's identifier (content hash), so
requests with the same image share one entry. Sizes count embedding rows.

Invariants: `num_free_slots + sum(sizes of cached entries) == cache_size`; an entry referenced
by a request is never evicted; unreferenced entries stay cached ("freeable") until space is
needed, then are evicted oldest first and reported once through `get_freed_mm_hashes()`, which
the scheduler sends to the workers.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedlm.core.request import Request


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.cached: dict[str, set[str]] = {}  # identifier -> ids of requests using it
        self.sizes: dict[str, int] = {}
        self.freeable: OrderedDict[str, None] = OrderedDict()  # cached, no request uses it
        self.freed: list[str] = []
        self.queries = self.hits = 0  # images looked up, found cached

    def check_and_update_cache(self, request: Request, index: int) -> bool:
        """Whether the request's image `index` is cached; if so the request now uses it."""
        identifier = request.mm_features[index].identifier
        users = self.cached.get(identifier)
        self.queries += 1
        if users is None:
            return False
        self.hits += 1
        users.add(request.request_id)
        self.freeable.pop(identifier, None)
        return True

    def can_allocate(self, request: Request, index: int, num_reserved: int) -> bool:
        """Whether the image fits beside `num_reserved` rows already promised this step,
        evicting unreferenced entries (oldest first) as needed."""
        needed = request.mm_features[index].num_embeds + num_reserved
        if needed > self.cache_size:
            return False
        while needed > self.num_free_slots and self.freeable:
            self._evict_oldest()
        return needed <= self.num_free_slots

    def _evict_oldest(self) -> None:
        identifier, _ = self.freeable.popitem(last=False)
        del self.cached[identifier]
        self.num_free_slots += self.sizes.pop(identifier)
        self.freed.append(identifier)

    def evict_unused(self) -> None:
        """Evict every entry no request uses (reset_mm_cache)."""
        while self.freeable:
            self._evict_oldest()

    def allocate(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        self.cached.setdefault(feature.identifier, set()).add(request.request_id)
        self.sizes[feature.identifier] = feature.num_embeds
        self.num_free_slots -= feature.num_embeds

    def free_encoder_input(self, request: Request, index: int) -> None:
        """The request no longer needs the image's output (its tokens are computed)."""
        identifier = request.mm_features[index].identifier
        users = self.cached.get(identifier)
        if users is None or request.request_id not in users:
            return
        users.discard(request.request_id)
        if not users:
            self.freeable[identifier] = None

    def free(self, request: Request) -> None:
        """Drop every reference of a finished or preempted request."""
        for index in range(len(request.mm_features)):
            self.free_encoder_input(request, index)

    def get_freed_mm_hashes(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    def reset(self) -> None:
        """Forget every entry: after a failed step, when the workers forget theirs too."""
        self.cached.clear()
        self.sizes.clear()
        self.freeable.clear()
        self.freed = []
        self.num_free_slots = self.cache_size

    def check_invariants(self) -> None:
        assert self.num_free_slots + sum(self.sizes.values()) == self.cache_size
        assert set(self.freeable) == {k for k, users in self.cached.items() if not users}
