"""vllm.tokenizers -> pagedlm.engine.tokenizer."""

from pagedlm.engine.tokenizer import get_tokenizer  # noqa: F401
