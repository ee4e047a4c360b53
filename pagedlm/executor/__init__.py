"""Executors run the workers: in this process (`uni`) or one process per rank (`mp`)."""

from pagedlm.executor.abstract import Executor

__all__ = ["Executor"]
