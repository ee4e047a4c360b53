"""vllm.v1.engine.exceptions -> pagedlm.exceptions."""

from pagedlm.exceptions import EngineDeadError, EngineGenerateError  # noqa: F401
