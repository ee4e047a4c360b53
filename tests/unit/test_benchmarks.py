"""The benchmarks' pure parts: throughput workloads are reproducible, rounds reduce to a median;
the pipe-slot microbenchmark's C source builds."""

from __future__ import annotations

import argparse
import importlib
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def throughput():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("throughput")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_median_round_keeps_every_total(throughput) -> None:
    rounds = [{"elapsed": 1.0, "total_tok_s": t} for t in (300.0, 100.0, 200.0)]
    rounds.append({"error": "exit 1"})
    median = throughput.median_round(rounds)
    assert median["total_tok_s"] == 200.0
    assert median["round_totals"] == [100.0, 200.0, 300.0]
    assert throughput.median_round(rounds[:2])["total_tok_s"] == 100.0  # lower of two
    assert throughput.median_round([{"error": "exit 1"}]) == {"error": "exit 1"}


@pytest.mark.parametrize("workload", ["random", "mixed", "shared-prefix"])
def test_workloads_are_reproducible(throughput, workload) -> None:
    args = argparse.Namespace(
        workload=workload, seed=0, num_prompts=8, input_len=16, output_len=4, prefix_len=32
    )
    first = throughput.make_requests(args, vocab=5000)
    assert first == throughput.make_requests(args, vocab=5000) and len(first) == 8
    assert all(1000 <= t < 4000 for prompt, _ in first for t in prompt)


@pytest.mark.parametrize(
    ("workload", "shape"), [("long", (8, 4096, 64)), ("long-single", (1, 16000, 32))]
)
def test_long_workloads_fix_their_lengths(throughput, workload, shape) -> None:
    args = argparse.Namespace(
        workload=workload, seed=0, num_prompts=64, input_len=16, output_len=4, prefix_len=32
    )
    requests = throughput.make_requests(args, vocab=5000)
    assert len(requests) == shape[0]
    assert all(len(p) == shape[1] and n == shape[2] for p, n in requests)


@pytest.mark.skipif(
    shutil.which("gcc") is None or platform.machine() != "x86_64", reason="needs gcc on x86-64"
)
def test_pipe_slots_source_compiles(tmp_path) -> None:
    """Every operation the pipe-slot microbenchmark lists builds into one valid C program (for
    AVX-512 BF16 targets: compiled, not run, so any x86-64 host checks it)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        pipe_slots = importlib.import_module("pipe_slots")
    finally:
        sys.path.remove(str(BENCHMARKS))
    src = tmp_path / "pipe_slots.c"
    src.write_text(pipe_slots.source())
    flags = ["-O2", "-mavx512f", "-mavx512bf16", "-mavx512dq", "-c", "-Werror"]
    build = subprocess.run(
        ["gcc", *flags, str(src), "-o", str(tmp_path / "pipe_slots.o")],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    assert pipe_slots.source().count("BENCH(b") == len(pipe_slots.OPERATIONS) + 1


def test_vl_shape_is_qwen2_5_vl_3b() -> None:
    """The random-weight Qwen2.5-VL-3B directory has the published model's 3,754,622,976
    parameters (embeddings tied) under its checkpoint names, and its vision token ids."""
    import math

    sys.path.insert(0, str(BENCHMARKS))
    try:
        shaped = importlib.import_module("make_shaped_vl_model")
    finally:
        sys.path.remove(str(BENCHMARKS))
    config = shaped.make_config("3b")
    specs = list(shaped.tensor_specs(config))
    assert sum(math.prod(shape) for _, shape, _ in specs) == 3_754_622_976
    assert {name.split(".")[0] for name, _, _ in specs} == {"model", "visual"}
    assert (config.image_token_id, config.vision_start_token_id) == (151655, 151652)
    assert config.text_config.rope_parameters["mrope_section"] == [16, 24, 24]


def test_scaling_merge_keeps_what_a_run_does_not_measure(tmp_path, monkeypatch, capsys) -> None:
    """`scaling.py --merge` replaces only the sizes and workloads it runs, lists every run,
    and its tables put sizes in size order whatever order the file holds them in."""
    import json

    sys.path.insert(0, str(BENCHMARKS))
    try:
        scaling = importlib.import_module("scaling")
    finally:
        sys.path.remove(str(BENCHMARKS))
    for size in ("0.5b", "3b"):
        (tmp_path / f"qwen2.5-{size}").mkdir()
        (tmp_path / f"qwen2.5-{size}" / "config.json").write_text("{}")
    out = tmp_path / "scaling.json"
    calls = []

    def fake_run(script, model, path, args, *extra):
        calls.append((Path(model).name, script))
        return {"vllm": {"total_tok_s": 100.0 + len(calls), "peak_rss_mb": 1.0}}

    monkeypatch.setattr(scaling, "run", fake_run)

    def main(*argv: str) -> dict:
        base = ["scaling.py", "--backends", "pagedlm,vllm", "--models-dir", str(tmp_path)]
        monkeypatch.setattr(sys, "argv", [*base, "--json", str(out), *argv])
        scaling.main()
        return json.loads(out.read_text())

    main("--sizes", "3b", "--workloads", "random,long")
    capsys.readouterr()
    merged = main("--sizes", "3b,0.5b", "--workloads", "random", "--merge")
    header = [line for line in capsys.readouterr().out.splitlines() if line.startswith("backend")]
    assert header[-1].split()[1:] == ["0.5b", "3b"]
    assert merged["sizes"]["3b"]["long"]["vllm"]["total_tok_s"] == 102.0  # kept
    assert merged["sizes"]["3b"]["random"]["vllm"]["total_tok_s"] == 103.0  # replaced
    assert set(merged["sizes"]["0.5b"]) == {"random"}
    assert [r["command"].count("--merge") for r in merged["runs"]] == [0, 1]
    replaced = main("--sizes", "0.5b", "--workloads", "random")  # no --merge: only this run
    assert set(replaced["sizes"]) == {"0.5b"} and "runs" not in replaced
