"""`get_rope`: one rotary embedding per set of arguments, shared by every layer that asks
(the cos/sin tables are read-only), and gone with the last model that holds it."""

from __future__ import annotations

import gc

import torch

from pagedlm.layers import rotary_embedding
from pagedlm.layers.rotary_embedding import MRotaryEmbedding, get_rope


def test_layers_share_one_rope_per_set_of_arguments() -> None:
    a = get_rope(64, 64, 2048, 1e6, None)
    assert get_rope(64, 64, 2048, 1e6, None) is a
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    others = [
        get_rope(64, 32, 2048, 1e6, None),
        get_rope(64, 64, 4096, 1e6, None),
        get_rope(64, 64, 2048, 1e4, None),
        get_rope(64, 64, 2048, 1e6, yarn),
    ]
    assert all(o is not a for o in others) and len({id(o) for o in others}) == 4
    assert get_rope(64, 64, 2048, 1e6, dict(yarn)) is others[3]
    assert isinstance(get_rope(64, 64, 2048, 1e6, {"mrope_section": [16, 8, 8]}), MRotaryEmbedding)
    with torch.device("meta"):
        assert get_rope(64, 64, 2048, 1e6, None).cos_cache.is_meta


def test_a_rope_goes_with_its_last_holder() -> None:
    ref = get_rope(48, 48, 128, 1e4, None)
    cos, live = ref.cos_cache.clone(), len(rotary_embedding._ROPES)
    del ref
    gc.collect()
    assert len(rotary_embedding._ROPES) == live - 1
    again = get_rope(48, 48, 128, 1e4, None)
    assert torch.equal(again.cos_cache, cos)  # rebuilt, the same values
