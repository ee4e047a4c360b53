"""`pagedlm run-batch`: the OpenAI batch file format end to end, on the tiny random Qwen2.

Decided behaviour checked here: a duplicate custom_id's first line runs and each later line gets
an error record, so that custom_id appears twice in the output (once ok, once error); a line
that is not JSON gets an error record with "custom_id": null; every error record carries the
input line number in error.line.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.entrypoints.chat_utils import render_conversations
from pagedlm.entrypoints.cli.main import build_parser
from pagedlm.entrypoints.openai.run_batch import load_existing_output, main

ROOT = Path(__file__).resolve().parents[2]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def engine_args(tiny_qwen2) -> list[str]:
    return ["--model", str(tiny_qwen2), "--max-model-len", "128", "--dtype", "float32"]


def line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def chat(text: str, **kw) -> dict:
    return {"model": "ignored", "messages": [{"role": "user", "content": text}], **kw}


def read_results(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), "the output ends with a partial line"
    return [json.loads(raw) for raw in data.splitlines()]


def test_mixed_file_good_and_bad_lines(tmp_path, engine_args, tiny_qwen2) -> None:
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    lines = [
        line("chat-1", CHAT, chat("Hello, my name is", logprobs=True, top_logprobs=2, **greedy)),
        line("cmpl-1", COMPLETIONS, {"prompt": "The capital of France is", "logprobs": 1,
                                     **greedy}),
        '{"custom_id": "broken", "method": ',  # 3: not JSON
        line("url-1", "/v1/nothing", {"prompt": "x"}),
        "",  # blank lines are skipped
        line("temp-1", COMPLETIONS, {"prompt": "hi", "temperature": -1}),
        line("long-1", COMPLETIONS, {"prompt": "The quick brown fox " * 60}),
        line("cmpl-1", COMPLETIONS, {"prompt": "a duplicate"}),
        line("emb-1", "/v1/embeddings", {"input": "embed me", "model": "m"}),
        line("n-1", COMPLETIONS, {"prompt": [5, 6, 7], "n": 2, "temperature": 0.8, "seed": 1,
                                  "max_tokens": 4, "ignore_eos": True, "unknown_field": 1}),
        line("many-1", COMPLETIONS, {"prompt": ["one", "two"]}),
        line("room-1", CHAT, chat("hi", max_completion_tokens=500)),
        line("stream-1", CHAT, chat("hi", stream=True)),
        line("chat-2", CHAT, chat("What is the meaning of life?", stop=["e"], max_tokens=20)),
    ]  # fmt: skip
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert main(["-i", str(inp), "-o", str(out), *engine_args]) == 1

    results = read_results(out)
    ids = [r["custom_id"] for r in results]
    assert sorted(ids, key=str) == sorted(
        ["chat-1", "cmpl-1", None, "url-1", "temp-1", "long-1", "cmpl-1", "emb-1", "n-1",
         "many-1", "room-1", "stream-1", "chat-2"], key=str,
    )  # fmt: skip
    ok = {r["custom_id"]: r for r in results if r["error"] is None}
    errors = {r["error"]["line"]: r for r in results if r["error"] is not None}
    assert set(ok) == {"chat-1", "cmpl-1", "n-1", "chat-2"}
    for r in ok.values():
        assert r["id"].startswith("batch_req_") and r["response"]["status_code"] == 200
        body = r["response"]["body"]
        assert body["model"] == str(tiny_qwen2) and body["choices"]
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    c1 = ok["chat-1"]["response"]["body"]
    assert c1["object"] == "chat.completion" and c1["id"].startswith("chatcmpl-")
    (choice,) = c1["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    (rendered,) = render_conversations(tok, [{"role": "user", "content": "Hello, my name is"}])
    assert c1["usage"]["prompt_tokens"] == len(rendered["prompt_token_ids"])
    assert c1["usage"]["completion_tokens"] == 6 == len(choice["logprobs"]["content"])
    for step in choice["logprobs"]["content"]:
        assert len(step["top_logprobs"]) == 2 and step["logprob"] <= 0
        assert step["top_logprobs"][0]["logprob"] == step["logprob"]  # greedy: the top token

    p1 = ok["cmpl-1"]["response"]["body"]
    assert p1["object"] == "text_completion" and p1["id"].startswith("cmpl-")
    assert p1["usage"]["prompt_tokens"] == len(tok.encode("The capital of France is"))
    assert p1["usage"]["completion_tokens"] == 6
    lp = p1["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 6
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"])

    n1 = ok["n-1"]["response"]["body"]
    assert [c["index"] for c in n1["choices"]] == [0, 1]
    assert n1["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}
    c2 = ok["chat-2"]["response"]["body"]["choices"][0]
    assert "e" not in c2["message"]["content"]
    if c2["finish_reason"] == "stop" and isinstance(c2["stop_reason"], str):
        assert c2["stop_reason"] == "e"

    expected = {  # input line -> words its error message must contain
        3: "Not valid JSON",
        4: "Unsupported url",
        6: "temperature",
        7: "maximum context length",
        8: "duplicate custom_id",
        9: "does not support the embeddings API",
        11: "one prompt per line",
        12: "maximum context length",
        13: "stream",
    }
    assert set(errors) == set(expected)
    for lineno, words in expected.items():
        r = errors[lineno]
        assert r["response"]["status_code"] == 400 and r["response"]["body"] is None
        assert r["error"]["code"] == 400 and words in r["error"]["message"], r["error"]
    assert errors[3]["custom_id"] is None and errors[8]["custom_id"] == "cmpl-1"


def test_greedy_results_match_llm_generate_and_chat(tmp_path, engine_args, tiny_qwen2) -> None:
    prompts = ["The capital of France is", "def reverse(s):", "To be or not"]
    questions = ["Hello, my name is", "What is the meaning of life?"]
    body = {"temperature": 0, "max_tokens": 12}
    lines = [line(f"p{i}", COMPLETIONS, {"prompt": p, **body}) for i, p in enumerate(prompts)]
    lines += [line(f"c{i}", CHAT, chat(q, **body)) for i, q in enumerate(questions)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert main(["-i", str(inp), "-o", str(out), *engine_args]) == 0
    got = {r["custom_id"]: r["response"]["body"] for r in read_results(out)}

    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = llm.generate(prompts, params, use_tqdm=False)
    expected += [llm.chat([{"role": "user", "content": q}], params, use_tqdm=False)[0]
                 for q in questions]  # fmt: skip
    keys = [f"p{i}" for i in range(len(prompts))] + [f"c{i}" for i in range(len(questions))]
    for key, ref in zip(keys, expected, strict=True):
        choice, usage = got[key]["choices"][0], got[key]["usage"]
        text = choice["message"]["content"] if key.startswith("c") else choice["text"]
        assert text == ref.outputs[0].text, key
        assert choice["finish_reason"] == ref.outputs[0].finish_reason
        assert usage["prompt_tokens"] == len(ref.prompt_token_ids)
        assert usage["completion_tokens"] == len(ref.outputs[0].token_ids)


def test_stdin_to_stdout(engine_args, monkeypatch, capsys) -> None:
    lines = [line("a", COMPLETIONS, {"prompt": "Hi", "max_tokens": 3}), "not json"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(lines).encode())))
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["-i", "-", "-o", "-", *engine_args]) == 1
    stdout.flush()
    results = [json.loads(raw) for raw in stdout.buffer.getvalue().decode().splitlines()]
    assert sorted(r["response"]["status_code"] for r in results) == [200, 400]
    err = capsys.readouterr().err
    assert "ok 1, failed 1, prompt tokens" in err and "tok/s" in err
    assert main(["-i", "-", "-o", "-", "--resume", *engine_args]) == 2  # resume needs a file


def test_help_and_subcommand_registration(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["run-batch", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--input-file" in out and "--resume" in out and "--max-model-len" in out


def test_resume_repairs_the_output(tmp_path) -> None:
    ok = {"id": "batch_req_1", "custom_id": "a", "response": {"status_code": 200}, "error": None}
    err = {"custom_id": None, "response": {"status_code": 400}, "error": {"code": 400, "line": 4}}
    path = tmp_path / "out.jsonl"
    path.write_bytes(
        f"{json.dumps(ok)}\nnot json\n{json.dumps(err)}\n".encode() + b'{"id": "batch_req_2", "cu'
    )
    state = load_existing_output(str(path))
    assert state.done_ids == {"a"} and state.done_lines == {4}
    assert (state.kept, state.failed) == (2, 1)
    assert path.read_text() == f"{json.dumps(ok)}\n{json.dumps(err)}\n"


def _wait_for_lines(path: Path, at_least: int, proc: subprocess.Popen, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        exited = proc.poll() is not None
        count = path.read_bytes().count(b"\n") if path.exists() else 0
        if count >= at_least:
            return count
        assert not exited, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.02)
    raise AssertionError(f"no {at_least} result lines after {timeout} s")


def test_interrupt_kill_and_resume(tmp_path, engine_args, capsys) -> None:
    n = 60
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(
        "".join(
            line(f"r{i}", COMPLETIONS, {"prompt": f"Request {i}: the quick brown fox",
                                        "max_tokens": 24, "ignore_eos": True, "temperature": 0})
            + "\n"
            for i in range(n)
        )
    )  # fmt: skip
    cmd = [sys.executable, "-m", "pagedlm.entrypoints.cli.main", "run-batch", "-i", str(inp),
           "-o", str(out), *engine_args, "--max-num-seqs", "8"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def start(*extra: str) -> subprocess.Popen:
        return subprocess.Popen([*cmd, *extra], cwd=ROOT, env=env, stderr=subprocess.PIPE)

    # Ctrl-C once the first results are on disk: a clean stop with exit status 130.
    proc = start()
    _wait_for_lines(out, 1, proc, timeout=120)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr.decode()
    assert b"--resume" in stderr
    first = read_results(out)
    assert 0 < len(first) < n and all(r["response"]["status_code"] == 200 for r in first)

    # SIGKILL in the middle of a resumed run, then a torn last line as a crash could leave it.
    proc = start("--resume")
    _wait_for_lines(out, len(first) + 1, proc, timeout=120)
    proc.kill()
    proc.communicate(timeout=60)
    with open(out, "ab") as f:
        f.write(b'{"id": "batch_req_torn", "custom_id": "r')

    # The rerun (in-process: a third interpreter start would only cost time) completes the file.
    capsys.readouterr()
    assert main(["-i", str(inp), "-o", str(out), "--resume", *engine_args]) == 0
    assert "partial last line" in capsys.readouterr().err
    results = read_results(out)
    assert sorted(r["custom_id"] for r in results) == sorted(f"r{i}" for i in range(n))
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 24 for r in results)


def test_a_request_failing_in_a_step_is_its_own_error_record(
    tmp_path, engine_args, monkeypatch
) -> None:
    """A request whose step raises inside the worker (injected: max_tokens=7) gets an error
    record with the cause; the line next to it in the same steps is answered as usual."""
    from pagedlm.worker import input_batch

    init = input_batch.CachedRequestState.__post_init__

    def fail_marked(state) -> None:
        if state.sampling_params is not None and state.sampling_params.max_tokens == 7:
            raise RuntimeError("injected worker failure")
        init(state)

    monkeypatch.setattr(input_batch.CachedRequestState, "__post_init__", fail_marked)
    greedy = {"temperature": 0, "ignore_eos": True}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(
        line("ok", COMPLETIONS, {"prompt": [5, 6, 7], "max_tokens": 5, **greedy})
        + "\n"
        + line("bad", COMPLETIONS, {"prompt": [5, 6, 8], "max_tokens": 7, **greedy})
        + "\n"
    )
    assert main(["-i", str(inp), "-o", str(out), *engine_args]) == 1
    results = {r["custom_id"]: r for r in read_results(out)}
    assert results["ok"]["error"] is None
    assert results["ok"]["response"]["body"]["usage"]["completion_tokens"] == 5
    assert results["bad"]["response"]["status_code"] == 500
    assert "injected worker failure" in results["bad"]["error"]["message"]
