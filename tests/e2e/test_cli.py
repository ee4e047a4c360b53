"""The `pagedlm` command: generate and an interactive chat that keeps the conversation."""

from __future__ import annotations

import io
import logging

import pytest

from pagedlm.entrypoints.cli.main import main


def test_generate(tiny_qwen2, capsys) -> None:
    rc = main(
        [
            "generate",
            "Hello there",
            "--model",
            str(tiny_qwen2),
            "--max-model-len",
            "64",
            "--dtype",
            "float32",
            "--max-tokens",
            "5",
        ]
    )
    assert rc == 0
    from pagedlm import LLM, SamplingParams

    llm = LLM(str(tiny_qwen2), max_model_len=64, dtype="float32")
    want = (
        llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    assert capsys.readouterr().out == want + "\n"


def test_chat_keeps_the_conversation(tiny_qwen2, monkeypatch, capsys) -> None:
    from pagedlm.entrypoints import llm as llm_module

    seen: list[int] = []
    original = llm_module.LLM.chat

    def spy(self, messages, *args, **kwargs):
        seen.append(len(messages))
        return original(self, messages, *args, **kwargs)

    monkeypatch.setattr(llm_module.LLM, "chat", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nAnd again\n\n"))
    rc = main(
        [
            "chat",
            "--model",
            str(tiny_qwen2),
            "--max-model-len",
            "128",
            "--dtype",
            "float32",
            "--max-tokens",
            "4",
            "--system",
            "Be brief.",
        ]
    )
    assert rc == 0
    assert seen == [2, 4]  # system + user, then + assistant reply + user
    assert len(capsys.readouterr().out.strip().splitlines()) >= 1


def test_help_lists_engine_options(capsys) -> None:
    try:
        main(["generate", "--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    assert "--max-model-len" in out and "--kv-cache-memory-bytes" in out


def test_user_errors_print_one_line_and_exit_2(tmp_path, capsys) -> None:
    missing = str(tmp_path / "no-such-model")
    assert main(["generate", "hi", "--model", missing]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedlm generate: error: Model path") and err.count("\n") == 1
    assert main(["generate", "hi", "--kv-cache-dtype", "fp4"]) == 2  # refused before loading
    err = capsys.readouterr().err
    assert "kv_cache_dtype must be one of" in err and err.count("\n") == 1
    assert main(["run-batch", "-i", str(tmp_path / "none.jsonl"), "-o", "-"]) == 2
    assert "cannot read the input file" in capsys.readouterr().err


def test_bad_flag_value_is_one_line_not_the_usage(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--max-model-len", "abc"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "pagedlm generate: error: argument --max-model-len: not a size: 'abc' "
        "(see pagedlm generate --help)\n"
    )


def test_debug_shows_the_traceback(tmp_path, monkeypatch) -> None:
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError):
        main(["generate", "hi", "--model", missing, "--debug"])
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    try:
        with pytest.raises(FileNotFoundError):
            main(["generate", "hi", "--model", missing])
        assert logging.getLogger("pagedlm").level == logging.DEBUG
    finally:
        logging.getLogger("pagedlm").setLevel(logging.NOTSET)
