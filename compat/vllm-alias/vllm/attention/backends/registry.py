"""vllm.attention.backends.registry: vLLM's backend names, importable (examples read them in
ROCm-only branches). pagedlm picks its own CPU kernels; `attention_backend=` is refused."""

import enum


class AttentionBackendEnum(enum.Enum):
    """vLLM's attention backend names; pagedlm runs none of them (LLM(attention_backend=...)
    raises NotImplementedError naming the option)."""

    FLASH_ATTN = "FLASH_ATTN"
    TRITON_ATTN = "TRITON_ATTN"
    ROCM_ATTN = "ROCM_ATTN"
    ROCM_AITER_FA = "ROCM_AITER_FA"
    FLEX_ATTENTION = "FLEX_ATTENTION"
    FLASHINFER = "FLASHINFER"
    TORCH_SDPA = "TORCH_SDPA"
    CPU_ATTN = "CPU_ATTN"
