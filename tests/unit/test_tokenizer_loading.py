"""How pagedlm asks transformers for a tokenizer."""

from __future__ import annotations


def test_false_mistral_regex_warning_is_answered_only_where_false(tmp_path, monkeypatch) -> None:
    """transformers 4.57.3+ (before 5) warns for any local tokenizer next to its config.json;
    pagedlm passes fix_mistral_regex=False for non-Mistral models only."""
    import json

    import transformers

    from pagedlm.engine.tokenizer import mistral_regex_kwargs

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    monkeypatch.setattr(transformers, "__version__", "4.57.6")
    assert mistral_regex_kwargs(str(tmp_path)) == {"fix_mistral_regex": False}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    assert mistral_regex_kwargs(str(tmp_path)) == {}
    assert mistral_regex_kwargs(str(tmp_path / "no-such-dir")) == {}
    monkeypatch.setattr(transformers, "__version__", "5.24.0")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert mistral_regex_kwargs(str(tmp_path)) == {}


def _qwen2_tokenizer(cls: type | None = None):  # a BPE vocabulary of ten tokens, two merges
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate("abcdefgh")} | {"ab": 8, "abc": 9}
    return (cls or Qwen2Tokenizer)(vocab=vocab, merges=[("a", "b"), ("ab", "c")])


def test_the_vocabulary_copies_go_where_nothing_reads_them() -> None:
    """transformers 5 keeps the vocab dict and merges list a Qwen2 tokenizer was built from
    (~60 MB on the default model) and reads them nowhere after: dropped, and it tokenizes
    as before; a class with a method that reads them keeps them."""
    import pytest
    import transformers

    from pagedlm.engine.tokenizer import drop_construction_copies

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4 keeps no such copies")
    tokenizer = _qwen2_tokenizer()
    ids = tokenizer("abcabd")["input_ids"]
    assert ids == [9, 8, 3]
    drop_construction_copies(tokenizer)
    assert tokenizer._vocab is None and tokenizer._merges is None
    assert tokenizer("abcabd")["input_ids"] == ids and tokenizer.decode(ids) == "abcabd"
    assert tokenizer.get_vocab()["abc"] == 9

    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    class SavesItsVocabulary(Qwen2Tokenizer):
        def save_vocabulary(self, save_directory, filename_prefix=None):
            return tuple(str(x) for x in (self._vocab, self._merges))

    keeps = _qwen2_tokenizer(SavesItsVocabulary)
    drop_construction_copies(keeps)
    assert keeps._vocab["abc"] == 9 and keeps._merges
