"""The `pagedlm` command: generate and an interactive chat that keeps the conversation."""

from __future__ import annotations

import io

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
