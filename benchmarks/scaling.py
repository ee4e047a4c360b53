"""The scaling table: random-weight models with Qwen2.5-0.5B, -1.5B and -3B's shapes
(make_shaped_model.py), each run by throughput.py (`random`, 32 x 256 in / 128 out; `long`,
8 x 4096 in / 64 out) and latency.py (batch 1) with the same backends in one run per size:

    .venv/bin/python benchmarks/scaling.py --vllm-python PEERS/vllm/bin/python \\
        --llamacpp-python PEERS/llamacpp/bin/python [--sizes 0.5b,1.5b,3b] \\
        [--backends pagedlm,pagedlm-int8,pagedlm-w8a8,vllm,vllm-w8a8,pagedlm-gguf,llamacpp] \\
        [--workloads random,long,batch1]

Models are written once under --models-dir (and their compressed-tensors W8A8 copies and
Q8_0 GGUF files beside them: make_shaped_gguf.py; `pagedlm-gguf` and `llamacpp` run those).
Writes benchmarks/results/scaling.json (plot.py draws it) and prints one table per workload:
total tok/s (decode tok/s at batch 1), peak RSS, and ratios to vLLM-CPU bf16.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import by_model_size, cache_dir, cpu_description  # noqa: E402
from make_shaped_gguf import make_shaped_gguf  # noqa: E402
from make_shaped_model import SHAPES, make_shaped_model  # noqa: E402

HERE = Path(__file__).parent
BACKENDS = "pagedlm,pagedlm-int8,pagedlm-w8a8,vllm,vllm-w8a8,pagedlm-gguf,llamacpp"


def run(script: str, model: Path, out: Path, args: argparse.Namespace, *extra: str) -> dict:
    cmd = [sys.executable, str(HERE / script), "--model", str(model), "--backends"]
    cmd += [args.backends, "--json", str(out), *extra]
    for flag, value in (
        ("--vllm-python", args.vllm_python),
        ("--llamacpp-python", args.llamacpp_python),
        ("--gguf", args.gguf),
    ):
        if value:
            cmd += [flag, value]
    print("$", " ".join(cmd[1:]), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    data = json.loads(out.read_text())
    return data.get("results", data)  # throughput.py nests its table under "results"


def print_tables(table: dict) -> None:
    for workload, metric, unit in (
        ("random", "total_tok_s", "total tok/s"),
        ("long", "total_tok_s", "total tok/s"),
        ("batch1", "decode_tok_s", "decode tok/s"),
    ):
        if not any(workload in cols for cols in table.values()):
            continue
        print(f"\n{workload}: {unit} (peak RSS MB) and ratio to vllm bf16")
        sizes = by_model_size(table)
        print(f"{'backend':<14}" + "".join(f"{s:>26}" for s in sizes))
        backends = {b for s in sizes for b in table[s].get(workload, {})}
        for b in sorted(backends):
            cells = []
            for s in sizes:
                cols = table[s].get(workload, {})
                r, base = cols.get(b, {}), cols.get("vllm", {})
                if metric not in r:
                    cells.append(f"{r.get('error', '-'):>26}")
                    continue
                ratio = f"{r[metric] / base[metric]:.2f}x" if metric in base else "-"
                cells.append(f"{r[metric]:>9.1f} ({r['peak_rss_mb']:>5.0f}) {ratio:>8}")
            print(f"{b:<14}" + "".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.5b,1.5b,3b")
    parser.add_argument("--backends", default=BACKENDS)
    parser.add_argument("--workloads", default="random,long,batch1")
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--llamacpp-python", default=None)
    parser.add_argument("--models-dir", default=str(cache_dir() / "shaped"))
    parser.add_argument("--json", default=str(HERE / "results" / "scaling.json"))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the sizes and workloads of the existing --json file that this run does not "
        "measure; its 'runs' list names every run merged into it",
    )
    args = parser.parse_args()
    table: dict[str, dict] = {}
    runs: list[dict] = []
    if args.merge and Path(args.json).is_file():
        previous = json.loads(Path(args.json).read_text())
        table = previous["sizes"]
        runs = previous.get("runs", [previous["source"]])
    for size in args.sizes.split(","):
        if size not in SHAPES:
            raise SystemExit(f"--sizes: {size!r} is not one of {', '.join(SHAPES)}")
        model = Path(args.models_dir) / f"qwen2.5-{size}"
        if not (model / "config.json").is_file():
            make_shaped_model(size, model)
        args.gguf = None
        if {"pagedlm-gguf", "llamacpp"} & set(args.backends.split(",")):
            args.gguf = str(model) + "-q8_0.gguf"
            if not Path(args.gguf).is_file():
                make_shaped_gguf(model, args.gguf + ".part", "Q8_0")
                Path(args.gguf + ".part").rename(args.gguf)
        tmp = f"/tmp/pagedlm_scaling_{size}"
        commands = {
            "random": ("throughput.py", "--workload", "random", "--num-prompts", "32",
                       "--input-len", "256", "--output-len", "128"),
            "long": ("throughput.py", "--workload", "long"),
            "batch1": ("latency.py", "--input-len", "128", "--output-len", "32",
                       "--repeats", "1"),
        }  # fmt: skip
        table.setdefault(size, {})
        for workload in args.workloads.split(","):
            if workload not in commands:
                raise SystemExit(f"--workloads: {workload!r} is not one of {', '.join(commands)}")
            script, *extra = commands[workload]
            out = Path(f"{tmp}_{workload}.json")
            table[size][workload] = run(script, model, out, args, *extra)
        print_tables(table)
        source = {
            "cpu": cpu_description(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "benchmarks/scaling.py " + " ".join(sys.argv[1:]),
        }
        document = {"source": source, "sizes": table}
        if args.merge:
            document["runs"] = [*runs, source]
        Path(args.json).write_text(json.dumps(document, indent=1))


if __name__ == "__main__":
    main()
