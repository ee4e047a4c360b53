"""Every environment variable pagedlm reads, declared once: name, default, meaning.

Read them as attributes (`envs.PAGEDLM_CACHE_DIR`); each access reads the environment anew, so
tests and launchers may set variables at any time. Code elsewhere must not call `os.environ`
for a variable that is not declared here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: Any
    parse: Callable[[str], Any]
    meaning: str


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


_VARS = [
    EnvVar("PAGEDLM_DEVICE", "auto", str, "auto, cpu or cuda: the device the engine runs on."),
    EnvVar(
        "PAGEDLM_CACHE_DIR",
        None,
        str,
        "Where packaged models are assembled and C kernels built (default: "
        "$XDG_CACHE_HOME/pagedlm, else ~/.cache/pagedlm).",
    ),
    EnvVar("XDG_CACHE_HOME", None, str, "Base of the default cache directory."),
    EnvVar("PAGEDLM_DISABLE_C_KERNELS", False, _flag, "1: use the PyTorch paths only."),
    EnvVar("PAGEDLM_DISABLE_PREPACK", False, _flag, "1: keep linear weights dense (no oneDNN)."),
    EnvVar(
        "PAGEDLM_DISABLE_AMX",
        False,
        _flag,
        "1: the C kernels take their AVX-512 paths where AMX would run (as on CPUs without "
        "AMX; for comparison and the tests of those paths). Read when the kernels load.",
    ),
    EnvVar(
        "PAGEDLM_GGUF_DEQUANTIZE",
        False,
        _flag,
        "1: GGUF weights are dequantized to the model dtype at load (when quantization is "
        "not given) instead of kept packed for the integer kernels.",
    ),
    EnvVar(
        "PAGEDLM_DISABLE_DECODE_PLAN",
        False,
        _flag,
        "1: small decode steps run the model's modules instead of the prepared kernel calls of "
        "models/llama_decode_plan.py (same results; for comparison and debugging).",
    ),
    EnvVar(
        "PAGEDLM_CHECK_KERNEL_ARGS",
        False,
        _flag,
        "1: the attention kernels' wrappers also check every block id they pass (debugging).",
    ),
    EnvVar(
        "VLLM_LOGGING_LEVEL",
        None,
        str,
        "Level of pagedlm's log in the `pagedlm` command (default WARNING; DEBUG also shows "
        "the traceback of an error).",
    ),
    EnvVar("CC", None, str, "C compiler for the kernels (default: gcc, else cc)."),
    EnvVar(
        "OMP_NUM_THREADS",
        None,
        int,
        "Compute threads of an in-process engine (default: one per physical core).",
    ),
    EnvVar(
        "VLLM_CPU_OMP_THREADS_BIND",
        "auto",
        str,
        "CPU ids of each worker process, ranks separated by '|' (e.g. '0-7|8-15'); 'auto' "
        "splits the usable CPUs evenly between ranks, 'nobind' does not pin.",
    ),
    EnvVar(
        "VLLM_CPU_KVCACHE_SPACE",
        None,
        float,
        "KV cache size in GiB (vLLM-CPU's legacy knob; kv_cache_memory_bytes wins).",
    ),
    EnvVar("VLLM_MAX_N_SEQUENCES", 16384, int, "Largest SamplingParams.n accepted."),
    EnvVar(
        "VLLM_IMAGE_FETCH_TIMEOUT",
        5.0,
        float,
        "Seconds an http(s) image URL of a chat message may take to download.",
    ),
    EnvVar("PYTHONHASHSEED", None, str, "Makes prefix-cache block hashes reproducible."),
    EnvVar("VLLM_DP_RANK", 0, int, "Data-parallel rank of this engine process."),
    EnvVar("VLLM_DP_SIZE", 1, int, "Number of data-parallel engine processes."),
    EnvVar(
        "PAGEDLM_WORKER_START_TIMEOUT",
        300.0,
        float,
        "Seconds the multiprocess executor waits for its workers to load the model.",
    ),
    EnvVar(
        "VLLM_WORKER_MULTIPROC_METHOD",
        None,
        str,
        "How the mp executor starts workers: spawn (default; the user's script is not re-run, "
        "so it needs no __main__ guard), fork or forkserver.",
    ),
    EnvVar(
        "PAGEDLM_RANK_FAILURE_GRACE",
        5.0,
        float,
        "Seconds the other ranks get to answer after one rank's call failed; ranks still "
        "waiting then (inside a collective, for the failed one) are stopped.",
    ),
    EnvVar(
        "VLLM_ALLOW_INSECURE_SERIALIZATION",
        False,
        _flag,
        "1: collective_rpc / apply_model may send callables (pickled code) to worker processes.",
    ),
]
_VARS += [
    EnvVar(
        "VLLM_TORCH_PROFILER_DIR",
        None,
        str,
        "Directory for torch profiler traces of start_profile()/stop_profile() (used when "
        "profiler_config is not given).",
    ),
    EnvVar("VLLM_TORCH_PROFILER_WITH_STACK", True, _flag, "Record Python stacks in traces."),
    EnvVar("VLLM_TORCH_PROFILER_RECORD_SHAPES", False, _flag, "Record operator input shapes."),
    EnvVar("VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY", False, _flag, "Record memory use."),
    EnvVar("VLLM_TORCH_PROFILER_WITH_FLOPS", False, _flag, "Estimate FLOPs of operators."),
    EnvVar("VLLM_TORCH_PROFILER_USE_GZIP", True, _flag, "Write traces as .json.gz."),
]
ENV_VARS: dict[str, EnvVar] = {v.name: v for v in _VARS}


def get(name: str) -> Any:
    """The variable's parsed value, or its default when unset or empty."""
    var = ENV_VARS[name]
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return var.default
    try:
        return var.parse(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r} is invalid: {var.meaning}") from e


def cache_dir() -> Path:
    """Where pagedlm writes: packaged models, converted tokenizers, built C kernels."""
    if get("PAGEDLM_CACHE_DIR"):
        return Path(get("PAGEDLM_CACHE_DIR"))
    base = get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedlm"


def __getattr__(name: str) -> Any:
    if name in ENV_VARS:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *ENV_VARS])
