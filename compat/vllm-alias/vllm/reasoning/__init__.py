"""vllm.reasoning: pagedlm has no reasoning parsers (`reasoning_parser=` is refused by name).
Importable, as vLLM's structured-output tests import it at module level; using it raises."""

from vllm._unsupported import unsupported_class

_WHY = "reasoning parsers are not implemented; LLM(reasoning_parser=...) is refused."
ReasoningParser = unsupported_class("vllm.reasoning.ReasoningParser", _WHY)
ReasoningParserManager = unsupported_class("vllm.reasoning.ReasoningParserManager", _WHY)
