"""What both Ray Data LLM chat jobs send and keep (vLLM's names only).

Imported by the job scripts and, through the pickled pre/postprocess functions, by Ray's
workers: the repository is on their PYTHONPATH (tests/ecosystem/conftest.py's run_client).
"""

try:  # the name up to Ray ~2.5x; newer Ray only has build_processor
    from ray.data.llm import build_llm_processor
except ImportError:
    from ray.data.llm import build_processor as build_llm_processor

__all__ = ["build_llm_processor", "chat_request", "chat_result", "questions"]


def questions(n: int) -> list[str]:
    return [f"Question {i}: what is {i} plus {i}?" for i in range(n)]


def chat_request(row: dict) -> dict:
    return {
        "messages": [{"role": "user", "content": row["question"]}],
        "sampling_params": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True},
    }


def chat_result(row: dict) -> dict:
    return {
        "id": row["id"],
        "prompt": row["prompt"],
        "answer": row["generated_text"],
        "tokens": [int(t) for t in row["generated_tokens"]],
    }
