"""vllm.envs -> pagedlm.envs: the variables pagedlm reads (vLLM's names where it shares them).

A vLLM variable pagedlm does not read is an AttributeError naming it, never a silent default.
"""

from pagedlm import envs as _envs


def __getattr__(name: str):
    if name in _envs.ENV_VARS:
        return _envs.get(name)
    raise AttributeError(
        f"vllm.envs.{name}: pagedlm does not read this variable (pagedlm.envs.ENV_VARS lists "
        "the ones it does)."
    )


def __dir__() -> list[str]:
    return sorted(_envs.ENV_VARS)
