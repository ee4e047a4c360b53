"""A tiny byte-level BPE tokenizer trained in-process, so tests never touch a model hub.

Ids: 0 = <pad>, 1 = <s> (BOS), 2 = </s> (EOS), 3 = <|user|>, 4 = <|assistant|>; byte-level,
so any UTF-8 text round-trips and multi-byte characters can span several tokens.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{% else %}<|assistant|>{% endif %}"
    "{{ m['content'] }}</s>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "Hello, my name is Alice and I like to write code in Python.",
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "A robot may not injure a human being or, through inaction, allow a human to come to harm.",
    "To be or not to be, that is the question.",
    "What is the meaning of life? Forty-two, according to some.",
    "def reverse(s): return s[::-1]  # reverse a string",
    "Les élèves déjà partis. Ünïcödé: 日本語のテキスト, emoji 🙂 and more.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
]


def build_tiny_tokenizer(path: Path | str, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on a small corpus and save it (with a chat template) to `path`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast
