"""vllm.pooling_params -> pagedlm.pooling_params."""

from pagedlm.pooling_params import PoolingParams  # noqa: F401
