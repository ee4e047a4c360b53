"""The command line of EngineArgs: one flag per field, help texts, sizes like `2k`, and the
parser that also takes vLLM's `--snake_case` spellings.

Fields vLLM has but pagedlm only accepts at vLLM's default are hidden flags: they parse (a
script written for vLLM runs), `--help` does not list them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import typing
from dataclasses import fields
from typing import Any, NoReturn

# What each pagedlm option does (`--help`, and the hint of its validation errors).
ENGINE_ARG_HELP: dict[str, str] = {
    "model": "Model: a Hugging Face directory, a .gguf file, a packaged model name or a hub id.",
    "runner": "auto, generate or pooling.",
    "convert": "auto, none, embed or classify: use a causal LM as a pooling model.",
    "tokenizer": "Tokenizer directory or hub id (default: the model's).",
    "dtype": "auto (bf16 where the CPU has native bf16, fp32 checkpoints stay fp32), "
    "float32, bfloat16, float16.",
    "max_model_len": "Longest prompt + output in tokens (default: from the model config). "
    "Accepts 1k, 2K, ...",
    "max_num_seqs": "Most requests running at once.",
    "max_num_batched_tokens": "Token budget of one engine step (prefill chunks + decodes).",
    "block_size": "Tokens per KV cache block.",
    "kv_cache_dtype": "auto (the model dtype), fp8 / fp8_e4m3 or fp8_e5m2 (half the KV memory).",
    "calculate_kv_scales": "fp8 KV cache: per-layer k/v scales from the first batch's maxima.",
    "kv_cache_memory_bytes": "KV cache size in bytes (default: a fraction of RAM).",
    "gpu_memory_utilization": "Fraction of device memory (RAM on CPU) the engine may use.",
    "num_gpu_blocks_override": "Force the number of KV blocks (testing preemption).",
    "enable_prefix_caching": "Reuse KV blocks of shared prompt prefixes.",
    "enable_chunked_prefill": "Split long prompts over several steps.",
    "scheduling_policy": "fcfs or priority (lower value first).",
    "seed": "Random seed of the engine.",
    "max_logprobs": "Most logprobs a request may ask for (-1: vocabulary size).",
    "disable_log_stats": "Do not keep metrics.",
    "generation_config": "auto (the model's generation_config.json), vllm (neutral) or a folder.",
    "override_generation_config": "JSON dict merged over the generation config.",
    "limit_mm_per_prompt": 'JSON dict: the most items per prompt by modality, e.g. {"image": 2} '
    "(default 999).",
    "mm_processor_kwargs": 'JSON dict passed to the image processor, e.g. {"max_pixels": 802816}.',
    "mm_processor_cache_gb": "GiB of processed images kept by content hash (0: none).",
    "allowed_local_media_path": "Directory under which file:// image URLs may be read.",
    "disable_chunked_mm_input": "Schedule each image's tokens in one step, never cut by a chunk.",
    "enforce_eager": "Accepted either way: pagedlm's CPU kernels always run eagerly.",
    "load_format": "auto, safetensors, pt (pytorch_model*.bin), gguf or dummy (random weights).",
    "quantization": "gguf (GGUF files: blocks kept packed, integer kernels; their default), "
    "int8 (W8A8 quantized at load, per channel, for bf16/fp32 checkpoints) or "
    "compressed-tensors (int8 W8A8 checkpoints; the default where the config names it).",
    "tensor_parallel_size": "Shard the model over this many worker processes (gloo on CPU).",
    "data_parallel_size": "Data-parallel engines are separate processes: see "
    "examples/data_parallel.py (VLLM_DP_RANK / VLLM_DP_SIZE).",
    "distributed_executor_backend": "uni (in this process) or mp (one process per rank; the "
    "default when tensor_parallel_size > 1); external_launcher (one engine in each calling "
    "process) only with tensor_parallel_size=1, where it means uni.",
    "prefix_caching_hash_algo": "sha256 (the only one supported).",
    "speculative_config": 'JSON dict: {"method": "ngram", "num_speculative_tokens": 3, '
    '"prompt_lookup_max": 4} or {"method": "draft_model", "model": ..., ...}.',
    "async_scheduling": "Refused when true: the CPU engine schedules synchronously.",
    "compilation_config": "Refused unless empty: pagedlm runs the model eagerly.",
    "model_impl": "auto or vllm: pagedlm's own model implementations (not transformers).",
    "enable_lora": "Serve PEFT LoRA adapters (LoRARequest per request).",
    "max_loras": "Most distinct LoRA adapters in one step (worker slots).",
    "max_lora_rank": "Largest LoRA rank accepted (slot size).",
    "max_cpu_loras": "LoRA adapters kept loaded in host memory (LRU); default max_loras.",
    "enable_sleep_mode": "Allow LLM.sleep(level=1|2): free the KV cache (and weights).",
    "weight_transfer_config": 'JSON dict or WeightTransferConfig: {"backend": "ipc"|"gloo"} '
    "for RL weight updates (init_weight_transfer_engine / update_weights).",
    "profiler_config": "JSON dict or ProfilerConfig (vLLM's fields): torch_profiler_dir, "
    "torch_profiler_record_shapes, torch_profiler_with_stack, ...",
    "logprobs_mode": "raw_logprobs, raw_logits, processed_logprobs or processed_logits.",
    "structured_outputs_config": "JSON dict: backend (auto/xgrammar), disable_any_whitespace, ...",
    "return_sampling_mask": "Return, per sampled token, the token ids that survived sampling.",
    "served_model_name": "The model name run-batch writes in its responses (default: --model).",
    "spec_method": "Shorthand for speculative_config's method (ngram, draft_model).",
    "spec_model": "Shorthand for speculative_config's draft model.",
    "spec_tokens": "Shorthand for speculative_config's num_speculative_tokens.",
}


def _parse_cli_value(value: str) -> Any:
    """A hidden vLLM-only flag's value: JSON where it parses (true, 3, {...}), else the string."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _parse_size(value: str) -> int:
    """'2048', '2k', '1M' (decimal) or '2K'/'1Mi' style -> int."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)i?\s*", str(value))
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {value!r}")
    number, unit = float(m.group(1)), m.group(2)
    scale = {"": 1, "k": 1000, "m": 10**6, "g": 10**9, "K": 1024, "M": 1024**2, "G": 1024**3}
    return int(number * scale[unit])


def add_engine_cli_args(
    parser: argparse.ArgumentParser, args_cls: type, hidden_fields: dict[str, Any]
) -> argparse.ArgumentParser:
    """One `--kebab-case` flag per field of the `args_cls` dataclass (booleans get `--no-`
    forms too); `hidden_fields` (name -> (accepted values, reason)) parse but are not listed."""
    group = parser.add_argument_group("engine options")
    hints = typing.get_type_hints(args_cls)
    for f in fields(args_cls):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        help_text = ENGINE_ARG_HELP.get(f.name, "See vLLM's option of the same name.")
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.name in hidden_fields:  # hidden: accepted at vLLM's default only
            hidden: dict[str, Any] = {"default": argparse.SUPPRESS, "help": argparse.SUPPRESS}
            if isinstance(hidden_fields[f.name][0][0], bool):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, **hidden)
            else:
                group.add_argument(flag, type=_parse_cli_value, **hidden)
            continue
        args = typing.get_args(kind)
        if kind is bool or (bool in args and len(args) <= 2 and str not in args):
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        elif f.name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            group.add_argument(flag, type=_parse_size, default=default, help=help_text)
        elif kind is Any or any(typing.get_origin(a) is dict for a in (kind, *args)):
            group.add_argument(flag, type=json.loads, default=default, help=help_text)
        elif kind is int or int in args:
            group.add_argument(flag, type=int, default=default, help=help_text)
        elif kind is float or float in args:
            group.add_argument(flag, type=float, default=default, help=help_text)
        else:
            group.add_argument(flag, type=str, default=default, help=help_text)
    return parser


class FlexibleArgumentParser(argparse.ArgumentParser):
    """ArgumentParser that also accepts `--snake_case` spellings and `--flag=value`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        if sys.version_info < (3, 13):  # `deprecated=` exists from Python 3.13 on
            kwargs.pop("deprecated", None)
        return super().add_argument(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        """One line and exit status 2 (the usage of every engine flag would bury the message)."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if args is None:
            args = sys.argv[1:]
        return super().parse_known_args(_normalize_flags(list(args)), namespace)


def _normalize_flags(args: list[str]) -> list[str]:
    out = []
    for arg in args:
        if arg.startswith("--") and not arg.startswith("---"):
            name, sep, value = arg[2:].partition("=")
            arg = "--" + name.replace("_", "-") + sep + value
        out.append(arg)
    return out
