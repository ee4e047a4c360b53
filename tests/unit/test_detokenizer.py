"""Unit tests for pagedlm.engine.detokenizer (incremental detokenization and stop strings)."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GPT2Tokenizer, PreTrainedTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pagedlm.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from pagedlm.engine.detokenizer_utils import convert_ids_list_to_tokens, correct_decoded_tokens
from tests.tiny_tokenizer import SPECIAL_TOKENS, build_tiny_tokenizer

FFFD = "\ufffd"
BOS, EOS, USER, ASSISTANT = 1, 2, 3, 4

TEXTS = [
    "Hello, my name is Alice and I like to write code in Python.",
    "The capital of France is Paris.",
    "Les élèves déjà partis. Ünïcödé!",
    "日本語のテキスト",
    "emoji 🙂 and more 🙂🙂 done",
    "  leading and  double  spaces ",
    "mixed é日🙂x",
]
_SP_CORPUS = [
    "Hello, my name is Alice and I like to write code in Python.",
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "To be or not to be, that is the question.",
    "The quick brown fox jumps over the lazy dog.",
]


def _build_sentencepiece_style(kind: str) -> PreTrainedTokenizerFast:
    """SentencePiece-like tokenizers built offline.

    ``llama``: Metaspace pre-tokenizer, Llama decoder (Replace, ByteFallback, Fuse, Strip) and
    byte-fallback tokens, trained on ASCII only so non-ASCII text goes through ``<0xNN>`` tokens.
    ``metaspace``: Metaspace pre-tokenizer and decoder (prepend_scheme="always").
    """
    tok = Tokenizer(models.BPE())
    scheme = "first" if kind == "llama" else "always"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    corpus = _SP_CORPUS if kind == "llama" else [*_SP_CORPUS, *TEXTS]
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    if kind == "llama":
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
        spec = json.loads(tok.to_str())
        vocab = spec["model"]["vocab"]
        for b in range(256):
            vocab.setdefault(f"<0x{b:02X}>", len(vocab))
        spec["model"]["byte_fallback"] = True
        tok = Tokenizer.from_str(json.dumps(spec))
    else:
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tok"))


class _SlowByteLevelBPE(PreTrainedTokenizer):
    """A slow (pure Python) byte-level BPE tokenizer splitting words with `bpe`'s model: the
    stand-in for transformers 5, whose GPT2Tokenizer is a fast one."""

    def __init__(self, bpe: Tokenizer, **kwargs) -> None:
        self._bpe = bpe
        self._vocab = bpe.get_vocab(with_added_tokens=False)
        self._ids = {i: t for t, i in self._vocab.items()}
        self._byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab, **self.added_tokens_encoder)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return self._bpe.encode(text, add_special_tokens=False).tokens

    def _convert_token_to_id(self, token: str) -> int:
        return self._vocab.get(token, 0)

    def _convert_id_to_token(self, index: int) -> str | None:
        return self._ids.get(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = bytearray(self._byte_decoder[c] for c in "".join(tokens))
        return data.decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def slow_tok(tok: PreTrainedTokenizerFast, tmp_path_factory: pytest.TempPathFactory):
    """A slow (pure Python) tokenizer with the same byte-level BPE vocab and merges."""
    specials = dict(
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<pad>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
    )
    if issubclass(GPT2Tokenizer, PreTrainedTokenizerFast):  # transformers >= 5
        return _SlowByteLevelBPE(tok._tokenizer, **specials)
    path = Path(tmp_path_factory.mktemp("slow_tok"))
    tok._tokenizer.model.save(str(path))
    return GPT2Tokenizer(
        vocab_file=str(path / "vocab.json"), merges_file=str(path / "merges.txt"), **specials
    )


@pytest.fixture(scope="module", params=["llama", "metaspace"])
def sp_tok(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return _build_sentencepiece_style(request.param)


def _enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _decode(tokenizer, ids: list[int], skip: bool, spaces: bool = True) -> str:
    kwargs = {"spaces_between_special_tokens": spaces} if not tokenizer.is_fast else {}
    return tokenizer.decode(
        ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False, **kwargs
    )


def _expected(tokenizer, prompt: list[int], gen: list[int], skip: bool, spaces: bool = True):
    """Generated text as decoded in the context of the prompt."""
    full = _decode(tokenizer, prompt + gen, skip, spaces)
    head = _decode(tokenizer, prompt, skip, spaces)
    assert full.startswith(head)
    return full[len(head) :]


def _feed(det: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Feed ``ids`` ``chunk`` at a time; returns the text after each update."""
    snapshots = []
    for i in range(0, len(ids), chunk):
        assert det.update(ids[i : i + chunk], False) is None
        snapshots.append(det.output_text)
    return snapshots


def _gen_ids(tokenizer) -> list[list[int]]:
    with_special = _enc(tokenizer, "Hi there") + [EOS, USER, ASSISTANT] + _enc(tokenizer, " ok 🙂")
    return [_enc(tokenizer, t) for t in TEXTS] + [with_special, [EOS, EOS, BOS]]


# --------------------------------------------------------------------------- incremental text


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_incremental_matches_decode_byte_level(tok, skip: bool, spaces: bool) -> None:
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi Bob"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,  # transformers 5 returns a BatchEncoding by default
    )
    for gen in _gen_ids(tok):
        det = IncrementalDetokenizer(
            tok, prompt, skip_special_tokens=skip, spaces_between_special_tokens=spaces
        )
        snapshots = _feed(det, gen)
        # Byte-level BPE: the text does not depend on the prompt context.
        assert det.output_text == _decode(tok, gen, skip)
        assert det.output_text == _expected(tok, prompt, gen, skip)
        assert det.token_ids == gen
        assert all(FFFD not in s for s in snapshots)
        # Text only ever grows.
        assert all(b.startswith(a) for a, b in pairwise(snapshots))


def test_incremental_chunked_updates(tok) -> None:
    gen = _enc(tok, "Les élèves 日本語 🙂 The capital of France is Paris.")
    for chunk in (2, 3, 7, len(gen)):
        det = IncrementalDetokenizer(tok, _enc(tok, "Question:"))
        _feed(det, gen, chunk)
        assert det.output_text == tok.decode(gen)


def test_multibyte_char_emitted_once_complete(tok) -> None:
    gen = _enc(tok, "a🙂")
    assert len(gen) >= 3  # the emoji spans several byte-level tokens
    det = IncrementalDetokenizer(tok, [BOS])
    snapshots = _feed(det, gen)
    assert snapshots[:-1] == ["a"] * (len(gen) - 1)
    assert snapshots[-1] == "a🙂"


def test_empty_and_short_prompts(tok) -> None:
    gen = _enc(tok, "Hello 日本語")
    for prompt in ([], [BOS], [BOS, USER]):
        det = IncrementalDetokenizer(tok, prompt)
        _feed(det, gen)
        assert det.output_text == tok.decode(gen)


def test_prompt_ending_mid_character(tok) -> None:
    ids = _enc(tok, "x 日本語")
    # Cut inside the multi-byte run: the rest of the character arrives as generated tokens.
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith(FFFD))
    det = IncrementalDetokenizer(tok, ids[:cut])
    snapshots = _feed(det, ids[cut:])
    assert all(FFFD not in s for s in snapshots)
    assert tok.decode(ids).endswith(det.output_text)
    assert det.output_text.endswith("語")


@pytest.mark.parametrize("skip", [True, False])
def test_sentencepiece_style_spacing(sp_tok, skip: bool) -> None:
    prompt = sp_tok.encode("Hi Bob") + [ASSISTANT]
    for gen in _gen_ids(sp_tok):
        det = IncrementalDetokenizer(sp_tok, prompt, skip_special_tokens=skip)
        snapshots = _feed(det, gen)
        assert det.output_text == _expected(sp_tok, prompt, gen, skip)
        assert all(FFFD not in s for s in snapshots)
    # The leading space of the first generated word is kept, as vLLM does.
    det = IncrementalDetokenizer(sp_tok, prompt, skip_special_tokens=skip)
    _feed(det, _enc(sp_tok, "Hello world"))
    assert det.output_text == " Hello world"


def test_sentencepiece_style_long_generation(sp_tok) -> None:
    text = " ".join(TEXTS * 3)
    gen = _enc(sp_tok, text)
    det = IncrementalDetokenizer(sp_tok, sp_tok.encode("Start:"))
    _feed(det, gen)
    assert det.output_text == " " + sp_tok.decode(gen, skip_special_tokens=True)


@pytest.mark.parametrize("skip", [True, False])
def test_slow_tokenizer_matches_decode(slow_tok, skip: bool) -> None:
    assert not slow_tok.is_fast
    prompt = [BOS, USER] + _enc(slow_tok, "Hi Bob") + [EOS, ASSISTANT]
    for gen in _gen_ids(slow_tok):
        det = IncrementalDetokenizer(
            slow_tok, prompt, skip_special_tokens=skip, spaces_between_special_tokens=False
        )
        snapshots = _feed(det, gen)
        assert det.output_text == _expected(slow_tok, prompt, gen, skip, spaces=False)
        assert all(FFFD not in s for s in snapshots)


def test_slow_tokenizer_spaces_between_special_tokens(slow_tok) -> None:
    # vLLM's slow path puts a space between added-token segments.
    prompt = [BOS] + _enc(slow_tok, "Hi")
    gen = _enc(slow_tok, "Hello") + [EOS, USER] + _enc(slow_tok, " ok")
    det = IncrementalDetokenizer(slow_tok, prompt, skip_special_tokens=False)
    _feed(det, gen)
    assert det.output_text == "Hello </s> <|user|>  ok"


def test_no_tokenizer_produces_no_text() -> None:
    det = IncrementalDetokenizer(None, [1, 2, 3], stop=["x"])
    assert det.update([5, 6], False) is None
    assert det.update([2], True) is None
    assert det.output_text == ""
    assert det.token_ids == [5, 6, 2]


def test_invalid_token_ids_are_ignored(tok) -> None:
    det = IncrementalDetokenizer(tok, [BOS])
    det.update(_enc(tok, "Hi"), False)
    det.update([10_000_000], False)
    det.update(_enc(tok, " there"), False)
    assert det.output_text == "Hi there"
    assert det.token_ids[-len(_enc(tok, " there")) - 1] == 10_000_000


# --------------------------------------------------------------------------- stop handling


def test_stop_terminated_token_excluded_from_text(tok) -> None:
    gen = _enc(tok, "To be or not")
    for skip in (True, False):
        det = IncrementalDetokenizer(tok, [BOS], skip_special_tokens=skip)
        _feed(det, gen)
        assert det.update([EOS], True) is None
        assert det.output_text == "To be or not"
        assert det.token_ids == gen + [EOS]

    # include_stop_str_in_output renders the stop token (visible when specials are kept).
    det = IncrementalDetokenizer(
        tok, [BOS], skip_special_tokens=False, include_stop_str_in_output=True
    )
    assert det.update(gen + [EOS], True) is None
    assert det.output_text == "To be or not</s>"
    assert det.token_ids == gen + [EOS]

    # A stop_token_id that is an ordinary token is excluded too.
    last = _enc(tok, "!")
    det = IncrementalDetokenizer(tok, [BOS])
    det.update(gen, False)
    det.update(last, True)
    assert det.output_text == "To be or not"
    assert det.token_ids == gen + last


@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_string_spanning_tokens(tok, chunk: int) -> None:
    gen = _enc(tok, "Hello, my name is Alice and I like to write code in Python.")
    stop = "me is Al"  # spans several tokens, starts and ends mid-token
    for include, expected in ((False, "Hello, my na"), (True, "Hello, my name is Al")):
        det = IncrementalDetokenizer(
            tok, [BOS], stop=["zzz", stop], include_stop_str_in_output=include
        )
        matched = None
        fed = 0
        while matched is None and fed < len(gen):
            matched = det.update(gen[fed : fed + chunk], False)
            fed += len(gen[fed : fed + chunk])
        assert matched == stop
        assert det.output_text == expected
        # Every generated token is kept; the stop completed within the last update.
        assert det.token_ids == gen[:fed]
        assert stop not in tok.decode(gen[: fed - chunk])
        # Further tokens are recorded but add no text.
        assert det.update(gen[fed : fed + 2], False) is None
        assert det.output_text == expected
        assert det.token_ids == gen[: fed + 2]


def test_stop_string_first_in_list_wins(tok) -> None:
    gen = _enc(tok, "The capital of France is Paris.")
    det = IncrementalDetokenizer(tok, [BOS], stop=["is", "Paris"])
    results = [det.update([t], False) for t in gen]
    assert [r for r in results if r] == ["is"]
    assert det.output_text == "The capital of France "


def test_stop_string_not_rechecked_in_old_text(tok) -> None:
    # A stop string that matched nothing is never searched again in earlier text.
    det = IncrementalDetokenizer(tok, [BOS], stop=["capital"])
    det.update(_enc(tok, "The cap"), False)
    assert det.update(_enc(tok, "ital of"), False) == "capital"
    assert det.output_text == "The "


def test_min_tokens_defers_stop_strings(tok) -> None:
    text = "The capital of France is Paris. The capital of Germany is Berlin."
    gen = _enc(tok, text)
    first = next(i for i in range(len(gen)) if "capital" in tok.decode(gen[: i + 1])) + 1

    det = IncrementalDetokenizer(tok, [BOS], stop=["capital"])
    assert [det.update([t], False) for t in gen[:first]][-1] == "capital"
    assert det.output_text == "The "

    for min_tokens in (first, first + 2):
        det = IncrementalDetokenizer(tok, [BOS], stop=["capital"], min_tokens=min_tokens)
        results = [det.update([t], False) for t in gen]
        hit = next(i for i, r in enumerate(results) if r)
        assert hit >= min_tokens
        assert det.output_text == "The capital of France is Paris. The "

    # Also with all tokens in one update: text within min_tokens is not searched.
    det = IncrementalDetokenizer(tok, [BOS], stop=["capital"], min_tokens=first)
    assert det.update(gen, False) == "capital"
    assert det.output_text == "The capital of France is Paris. The "

    # Nothing is checked at all while len(token_ids) <= min_tokens.
    det = IncrementalDetokenizer(tok, [BOS], stop=["capital"], min_tokens=len(gen))
    assert det.update(gen, False) is None
    assert det.output_text == text


def test_check_stop_strings_helper() -> None:
    assert check_stop_strings("abcdef", 0, ["cd"], False) is None
    assert check_stop_strings("abcdef", 1, ["cd"], False) is None
    assert check_stop_strings("abcdef", 3, ["cd"], False) == ("cd", 2)
    assert check_stop_strings("abcdef", 3, ["cd"], True) == ("cd", 4)
    assert check_stop_strings("abcdef", 1, ["ef"], True) == ("ef", -1)
    assert check_stop_strings("abcdef", 100, ["ab"], False) == ("ab", 0)


# --------------------------------------------------------------------------- streaming


def test_streaming_holds_back_partial_stop(tok) -> None:
    text = "To be or not to be, that is the question."
    gen = _enc(tok, text)
    stop = ["question", "zz"]
    det = IncrementalDetokenizer(tok, [BOS], stop=stop)
    assert det.stop_buffer_length == len("question") - 1
    streamed = ""
    matched = None
    for t in gen:
        matched = det.update([t], False)
        if matched:
            break
        streamed += det.get_next_output_text(finished=False, delta=True)
        assert det.get_next_output_text(finished=False, delta=False) == streamed
        assert streamed == det.output_text[: max(len(det.output_text) - 7, 0)]
        # Never show the beginning of the stop string.
        assert "q" not in streamed
    assert matched == "question"
    streamed += det.get_next_output_text(finished=True, delta=True)
    assert streamed == det.output_text == "To be or not to be, that is the "
    assert det.get_next_output_text(finished=True, delta=True) == ""
    assert det.get_next_output_text(finished=True, delta=False) == det.output_text


def test_streaming_without_stop_or_with_include(tok) -> None:
    gen = _enc(tok, "Hello 🙂 world")
    for kwargs in ({}, {"stop": ["world"], "include_stop_str_in_output": True}):
        det = IncrementalDetokenizer(tok, [BOS], **kwargs)
        assert det.stop_buffer_length == 0
        streamed = ""
        for t in gen:
            det.update([t], False)
            streamed += det.get_next_output_text(finished=False, delta=True)
            assert streamed == det.output_text
        assert streamed == "Hello 🙂 world"


# --------------------------------------------------------------------------- per-token strings


def test_convert_ids_list_to_tokens_matches_single_decode(tok, slow_tok) -> None:
    ids = list(range(len(tok)))
    expected = [tok.decode([i]) for i in ids]
    assert convert_ids_list_to_tokens(tok, ids) == expected
    assert convert_ids_list_to_tokens(tok, ids[::-1]) == expected[::-1]  # cached path
    assert convert_ids_list_to_tokens(slow_tok, ids[:60]) == [
        slow_tok.decode([i]) for i in ids[:60]
    ]
    assert convert_ids_list_to_tokens(tok, [EOS, BOS, ASSISTANT]) == [
        "</s>",
        "<s>",
        "<|assistant|>",
    ]
    assert convert_ids_list_to_tokens(tok, []) == []
    # Out-of-vocabulary ids (a padded model vocab) give "".
    assert convert_ids_list_to_tokens(tok, [len(tok) + 5, EOS]) == ["", "</s>"]


def test_convert_ids_list_to_tokens_partial_utf8(tok, sp_tok) -> None:
    for tokenizer in (tok, sp_tok):
        ids = _enc(tokenizer, "日本語🙂")
        pieces = convert_ids_list_to_tokens(tokenizer, ids)
        assert pieces == [tokenizer.decode([i]) for i in ids]
        # Byte-level and byte-fallback tokenizers split the characters into bytes.
        if len(ids) > 4:
            assert any(FFFD in p for p in pieces)


def test_convert_ids_list_to_tokens_cleanup_spaces(tmp_path: Path) -> None:
    tokenizer = build_tiny_tokenizer(tmp_path)
    tokenizer.clean_up_tokenization_spaces = True
    ids = list(range(len(tokenizer)))
    assert convert_ids_list_to_tokens(tokenizer, ids) == [tokenizer.decode([i]) for i in ids]


def _sampled_one_by_one(tokenizer, ids: list[int]) -> list[str]:
    """decoded_token of each id as the output processor gives it when they are sampled in turn."""
    pieces = []
    for i, token_id in enumerate(ids):
        texts = convert_ids_list_to_tokens(tokenizer, [token_id])
        pieces += correct_decoded_tokens(tokenizer, texts, [token_id], ids[max(0, i - 4) : i])
    return pieces


@pytest.mark.parametrize("text", ["日本語🙂", "mixédé日🙂x"])
def test_correct_decoded_tokens_completes_byte_fallback_characters(sp_tok, text) -> None:
    """Byte-fallback pieces of a partial character give "" and the piece that completes it
    gives the whole character, so the pieces join into the text."""
    pieces = _sampled_one_by_one(sp_tok, _enc(sp_tok, text))
    assert not any(FFFD in p for p in pieces)
    assert "".join(pieces) == sp_tok.decode(_enc(sp_tok, text))


def test_correct_decoded_tokens_matches_vllm_on_byte_level_bpe(tok) -> None:
    # Recorded from vLLM 0.32.0 (LogprobsProcessor._verify_tokens) on this tokenizer. Byte-level
    # tokens that straddle characters lose text there; pagedlm answers the same.
    assert _sampled_one_by_one(tok, _enc(tok, "日本語🙂")) == [
        "", "", "", "", "\ufffd語", "", "", "", "🙂",
    ]  # fmt: skip
    assert _sampled_one_by_one(tok, _enc(tok, "mixed é日🙂x")) == [
        "m", "i", "x", "e", "d", " ", "é", "", "日", "", "", "", "🙂", "x",
    ]  # fmt: skip
    assert _sampled_one_by_one(tok, _enc(tok, "Les élèves")) == ["Les", " ", "é", "", "\ufffdves"]


def test_correct_decoded_tokens_leaves_whole_strings(tok) -> None:
    ids = _enc(tok, "Hello there")
    clean = convert_ids_list_to_tokens(tok, ids)
    assert correct_decoded_tokens(tok, list(clean), ids, []) == clean
    first_piece = _enc(tok, "日")[:1]  # a partial character, with no context to complete it
    assert convert_ids_list_to_tokens(tok, first_piece) == [FFFD]
    assert correct_decoded_tokens(tok, [FFFD], first_piece, []) == [""]


@pytest.mark.parametrize("flat", [False, True])
def test_sample_logprobs_complete_partial_characters(sp_tok, flat: bool) -> None:
    """The output processor corrects decoded_token with the tokens sampled before it."""
    from pagedlm.engine.input_processor import EngineCoreRequest
    from pagedlm.engine.output_processor import RequestState
    from pagedlm.runner_outputs import LogprobsLists
    from pagedlm.sampling_params import SamplingParams

    params = SamplingParams(logprobs=1, flat_logprobs=flat)
    request = EngineCoreRequest("r", None, [BOS], params, eos_token_id=EOS, arrival_time=0.0)
    state = RequestState(request, "r", sp_tok, None, child_index=0, log_stats=False)
    ids = _enc(sp_tok, "日本")
    for token_id in ids:  # the first piece is also every position's alternative
        state.add_logprobs(LogprobsLists([[token_id, ids[0]]], [[-0.1, -0.2]], [1]), prompt=False)
    assert state.logprobs is not None
    assert (
        "".join(position[t].decoded_token for position, t in zip(state.logprobs, ids, strict=True))
        == "日本"
    )
