"""vllm.tasks: the task names of `LLM.supported_tasks` and `encode(pooling_task=...)`."""

from typing import Literal, get_args

GenerationTask = Literal["generate", "transcription"]
GENERATION_TASKS = get_args(GenerationTask)
PoolingTask = Literal["embed", "classify", "score", "token_embed", "token_classify", "plugin"]
POOLING_TASKS = get_args(PoolingTask)
SupportedTask = Literal[GenerationTask, PoolingTask]
