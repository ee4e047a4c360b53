"""pagedlm under the name `vllm` (the opt-in alias distribution).

Every object is pagedlm's own (not a copy), so isinstance checks hold either way round.
Names pagedlm does not provide raise AttributeError naming what is missing."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from pagedlm import *  # noqa: F403
from pagedlm import __all__ as _pagedlm_all
from vllm import (  # noqa: F401  (vllm.outputs etc. are attributes of the package, as in vLLM)
    config,
    engine,
    entrypoints,
    inputs,
    logprobs,
    lora,
    outputs,
    pooling_params,
    sampling_params,
)

try:
    __version__ = _version("vllm")
except PackageNotFoundError:  # imported from a source tree
    __version__ = "0.19.0+pagedlm"
__version_tuple__ = tuple(int(p) for p in __version__.split("+")[0].split("."))

__all__ = [n for n in _pagedlm_all if not n.startswith("__")] + ["__version__", "__version_tuple__"]


def __getattr__(name: str):
    if name == "initialize_ray_cluster":
        raise AttributeError(
            "vllm.initialize_ray_cluster is not provided by pagedlm: it runs one engine process "
            "per replica (scale out with Ray Data instead; see docs/ecosystem.md)."
        )
    raise AttributeError(f"pagedlm's vllm alias has no attribute {name!r} (not implemented).")
