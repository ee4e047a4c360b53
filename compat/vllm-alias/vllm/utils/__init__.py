"""vllm.utils (older vLLM kept FlexibleArgumentParser here)."""

from pagedlm.engine.arg_utils import FlexibleArgumentParser  # noqa: F401
