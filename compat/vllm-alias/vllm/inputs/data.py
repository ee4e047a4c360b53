"""vllm.inputs.data (vLLM < 0.19) -> pagedlm.inputs."""

from pagedlm.inputs import (  # noqa: F401
    DataPrompt,
    EmbedsPrompt,
    ExplicitEncoderDecoderPrompt,
    PromptType,
    SingletonPrompt,
    TextPrompt,
    TokensPrompt,
)
