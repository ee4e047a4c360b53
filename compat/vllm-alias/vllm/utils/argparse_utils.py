"""vllm.utils.argparse_utils -> pagedlm.engine.arg_utils."""

from pagedlm.engine.arg_utils import FlexibleArgumentParser  # noqa: F401
