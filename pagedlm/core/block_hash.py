"""Prefix-cache block hashes: sha256 over (parent hash, block token ids, extra keys).

The first block's parent is a per-process constant (derived from PYTHONHASHSEED when set,
random otherwise), so hashes are chained: equal hashes mean equal whole prefixes. Extra keys:
the cache salt (and LoRA adapter) in the first block, and in every block the identifiers of
the images whose placeholder tokens it holds (equal placeholder tokens of different images
never share KV).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from typing import TYPE_CHECKING

import numpy as np

from pagedlm import envs

if TYPE_CHECKING:
    from pagedlm.multimodal.inputs import MultiModalFeatureSpec


def _init_none_hash() -> bytes:
    seed = envs.PYTHONHASHSEED
    if seed is None:
        return os.urandom(32)
    return hashlib.sha256(seed.encode()).digest()


NONE_HASH = _init_none_hash()


def hash_block_tokens(parent: bytes | None, token_ids: list[int], extra_keys: object) -> bytes:
    h = hashlib.sha256(parent or NONE_HASH)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_keys is not None:
        h.update(pickle.dumps(extra_keys))
    return h.digest()


def hash_request_blocks(
    token_ids: list[int],
    block_size: int,
    existing: list[bytes],
    cache_salt: object,
    mm_features: list[MultiModalFeatureSpec] | None = None,
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` after the `len(existing)` already hashed;
    `cache_salt` (a str, or a tuple with the request's LoRA adapter) goes into the first, the
    identifiers of `mm_features` overlapping a block into that block."""
    new: list[bytes] = []
    parent = existing[-1] if existing else None
    start = len(existing) * block_size
    while start + block_size <= len(token_ids):
        extra: object = cache_salt if start == 0 and cache_salt else None
        if mm_features:
            end = start + block_size
            images = tuple(f.identifier for f in mm_features if f.mm_position.overlaps(start, end))
            if images:
                extra = (extra, images)
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        new.append(parent)
        start += block_size
    return new
