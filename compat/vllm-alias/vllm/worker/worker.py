"""vllm.worker.worker -> pagedlm.worker.worker (the Worker collective_rpc calls reach)."""

from pagedlm.worker.worker import Worker  # noqa: F401
