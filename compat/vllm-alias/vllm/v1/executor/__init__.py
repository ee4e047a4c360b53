"""vllm.v1.executor -> pagedlm.executor (the executor interface)."""

from pagedlm.executor.abstract import Executor  # noqa: F401
