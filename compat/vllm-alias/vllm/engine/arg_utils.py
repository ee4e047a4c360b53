"""vllm.engine.arg_utils -> pagedlm.engine.arg_utils."""

from pagedlm.engine.arg_utils import AsyncEngineArgs, EngineArgs  # noqa: F401
