"""vllm.utils.network_utils -> pagedlm.distributed."""

from pagedlm.distributed.network_utils import get_ip, get_open_port  # noqa: F401
