"""vllm.reasoning.abs_reasoning_parsers: see vllm.reasoning."""

from vllm.reasoning import ReasoningParser, ReasoningParserManager  # noqa: F401
