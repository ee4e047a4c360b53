"""Small helpers with no pagedlm dependencies, shared by every layer."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers: the blocks `a` tokens need at `b` per block."""
    return -(-a // b)
