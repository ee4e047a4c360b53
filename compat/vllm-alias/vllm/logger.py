"""vllm.logger: `init_logger(name)` is a standard logging logger (pagedlm logs under 'pagedlm')."""

import logging


def init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)
