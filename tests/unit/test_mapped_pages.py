"""Mapped files hold memory only while it is read: utils.release_mapped_pages and the
checkpoint readers that use it (measured in /proc/self/smaps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedlm.utils import release_mapped_pages
from tests.proc_maps import HAS_SMAPS, resident_kb


@pytest.mark.skipif(not HAS_SMAPS, reason="reads Linux's smaps")
def test_release_mapped_pages_drops_residency_and_keeps_the_data(tmp_path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(np.arange(1 << 22, dtype=np.uint8).tobytes())  # 4 MiB
    data = np.memmap(path, dtype=np.uint8, mode="r")
    want = int(data.astype(np.int64).sum())  # touches every page

    assert resident_kb(path)[1] >= 4000
    release_mapped_pages(data.ctypes.data, data.nbytes)
    assert resident_kb(path)[1] < 100
    assert int(data.astype(np.int64).sum()) == want  # read again from the page cache


@pytest.mark.skipif(not HAS_SMAPS, reason="reads Linux's smaps")
def test_safetensors_loading_holds_one_tensor_of_the_file_at_a_time(tmp_path) -> None:
    """Each tensor's pages of the checkpoint leave this process once the next one is read, so
    loading holds the weights once (their copies), not twice."""
    from safetensors.torch import save_file

    from pagedlm.model_loader.safetensors_loader import iterate_safetensors

    tensors = {f"w{i}": torch.full((256, 1024), float(i)) for i in range(8)}  # 1 MiB each
    save_file(tensors, str(tmp_path / "model.safetensors"))
    most_kb = 0
    for name, tensor in iterate_safetensors(tmp_path):
        assert torch.equal(tensor.clone(), tensors[name])  # reads its pages
        most_kb = max(most_kb, resident_kb(tmp_path / "model.safetensors")[1])
    assert most_kb < 2 * 1024 + 128, most_kb  # at most about two tensors, not all eight
