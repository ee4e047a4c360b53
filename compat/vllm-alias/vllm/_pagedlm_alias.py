"""Marks this `vllm` as pagedlm's alias (setup.py and tests look for it)."""

ALIAS_OF = "pagedlm"
