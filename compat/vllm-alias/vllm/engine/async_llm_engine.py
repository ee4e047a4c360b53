"""vllm.engine.async_llm_engine -> pagedlm.engine.async_llm."""

from pagedlm.engine.async_llm import AsyncLLMEngine  # noqa: F401
