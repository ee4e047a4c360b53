"""vllm.utils.network_utils -> pagedlm.distributed."""

from pagedlm.distributed import get_ip, get_open_port  # noqa: F401
