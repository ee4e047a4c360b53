"""vllm.v1.engine.async_llm -> pagedlm.engine.async_llm."""

from pagedlm.engine.async_llm import AsyncLLM  # noqa: F401
