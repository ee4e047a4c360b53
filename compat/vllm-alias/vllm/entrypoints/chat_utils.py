"""vllm.entrypoints.chat_utils -> pagedlm.entrypoints.chat_utils."""

from pagedlm.entrypoints.chat_utils import resolve_hf_chat_template  # noqa: F401
