"""vllm.inputs -> pagedlm.inputs."""

from pagedlm.inputs import (  # noqa: F401
    DataPrompt,
    EmbedsPrompt,
    ExplicitEncoderDecoderPrompt,
    PromptType,
    SingletonPrompt,
    TextPrompt,
    TokensPrompt,
)
