"""vllm.platforms -> pagedlm.platforms (`current_platform` is pagedlm's own object)."""

from pagedlm.platforms import Platform, current_platform  # noqa: F401
