"""pagedlm's GGUF metadata reader against the gguf library's own reader: string arrays (a
vocabulary) are decoded where read, to the same values; a truncated file is a clear error."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pagedlm.model_loader.gguf_reader import GGUFFile, GGUFStringArray

TOKENS = ["<s>", "héllo", "", "Ġworld", "日本", "x" * 300]


@pytest.fixture
def small_gguf(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1, 2, 3, 1, 1, 1])
    writer.add_string("general.name", "small")
    writer.add_tensor("w", np.arange(32, dtype=np.float32).reshape(2, 16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_string_arrays_read_as_the_gguf_library_reads_them(small_gguf) -> None:
    meta = GGUFFile(small_gguf).metadata
    tokens = meta["tokenizer.ggml.tokens"]
    assert isinstance(tokens, GGUFStringArray)
    theirs = gguf.GGUFReader(str(small_gguf)).fields["tokenizer.ggml.tokens"].contents()
    assert list(tokens) == theirs == TOKENS
    assert len(tokens) == 6 and tokens[-1] == TOKENS[-1] and tokens[1:3] == TOKENS[1:3]
    with pytest.raises(IndexError):
        tokens[6]
    # what follows the array parsed from the right place
    assert meta["tokenizer.ggml.token_type"] == [1, 2, 3, 1, 1, 1]
    assert meta["general.name"] == "small"


def test_truncated_vocabulary_is_a_clear_error(small_gguf, tmp_path) -> None:
    data = small_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: data.index(b"\xe6\x97\xa5")])  # inside the token list
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        GGUFFile(cut)
