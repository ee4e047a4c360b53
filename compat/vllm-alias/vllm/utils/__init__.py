"""vllm.utils (older vLLM kept FlexibleArgumentParser and the network helpers here)."""

from pagedlm.distributed.network_utils import get_ip, get_open_port  # noqa: F401
from pagedlm.engine.arg_utils import FlexibleArgumentParser  # noqa: F401
