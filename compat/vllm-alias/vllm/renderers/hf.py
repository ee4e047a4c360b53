"""vllm.renderers.hf -> pagedlm.entrypoints.chat_utils."""

from pagedlm.entrypoints.chat_utils import resolve_hf_chat_template  # noqa: F401
from pagedlm.entrypoints.chat_utils import (  # noqa: F401
    resolve_hf_chat_template as resolve_chat_template,
)
