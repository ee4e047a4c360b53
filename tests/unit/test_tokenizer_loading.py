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
