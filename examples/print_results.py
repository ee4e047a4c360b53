"""Print the answers of a `pagedlm run-batch` results file, one block per request.

python examples/print_results.py results.jsonl
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            print(f"### {record['custom_id']}")
            if record.get("error"):
                print(f"ERROR: {record['error']['message']}\n")
                continue
            for choice in record["response"]["body"]["choices"]:
                text = choice["message"]["content"] if "message" in choice else choice["text"]
                print(f"{text}\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "results.jsonl")
