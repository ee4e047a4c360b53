"""vllm.exceptions -> pagedlm.exceptions."""

from pagedlm.exceptions import VLLMValidationError  # noqa: F401
