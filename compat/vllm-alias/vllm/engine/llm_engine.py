"""vllm.engine.llm_engine -> pagedlm.engine.llm_engine."""

from pagedlm.engine.llm_engine import LLMEngine  # noqa: F401
