"""Names vLLM has and pagedlm does not: importable (scripts import them at module level),
an error naming what is missing when used."""

from typing import Any


def unsupported_class(qualname: str, why: str) -> type:
    """A class that raises NotImplementedError when instantiated."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{qualname} is not provided by pagedlm: {why}")

    module, _, name = qualname.rpartition(".")
    return type(name, (), {"__init__": __init__, "__module__": module, "__doc__": why})


def unsupported_function(qualname: str, why: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{qualname} is not provided by pagedlm: {why}")

    call.__qualname__ = call.__name__ = qualname.rpartition(".")[2]
    return call


def missing_attribute(module: str, name: str) -> AttributeError:
    return AttributeError(f"pagedlm's vllm alias has no {module}.{name} (not implemented).")
