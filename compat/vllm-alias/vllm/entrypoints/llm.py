"""vllm.entrypoints.llm -> pagedlm.entrypoints.llm."""

from pagedlm.entrypoints.llm import LLM  # noqa: F401
