"""Byte-level BPE tokenizer with a chat template, trained from scratch with the `tokenizers` library.

The result is a standard Hugging Face fast tokenizer: `save_pretrained(dir)` then
`AutoTokenizer.from_pretrained(dir)` gives it back. Any unicode text round-trips exactly
(`decode(encode(x)) == x`): byte-level alphabet, no normaliser, no prefix space, no clean-up.
Digits are split one per token (as in Llama), which makes the worked arithmetic of the embedded
corpus learnable.

Chat format (`CHAT_TEMPLATE`), one string per conversation, no newlines added:

    <|bos|><|user|>{user}<|end|><|assistant|>{reply}<|end|><|user|>{user}<|end|>...

`eos_token` is `<|end|>`, the end of every turn, so generation stops at the end of the assistant
reply; `add_generation_prompt=True` appends `<|assistant|>`. The assistant content and its `<|end|>`
are wrapped in `{% generation %}` so `apply_chat_template(..., return_assistant_tokens_mask=True)`
marks exactly the tokens a model is trained to produce.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS = "<|bos|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END = "<|end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, END, SYSTEM, USER, ASSISTANT)  # ids 0..5 in this order

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% elif message['role'] in ['user', 'system'] %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% else %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2, model_max_length: int = 512
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with the chat special tokens and template.

    Args:
        texts: training texts (message contents or plain documents; special tokens are added apart).
        vocab_size: target vocabulary size including the 256 byte tokens and the special tokens; the
            result is smaller when the texts have fewer merges than that.
        min_frequency: a pair must occur this often to be merged.
        model_max_length: context length the tokenizer reports (tokens).

    Returns:
        A fast tokenizer with `bos_token`, `eos_token` (= `<|end|>`), `pad_token` and `chat_template` set.

    Raises:
        ValueError: `vocab_size` leaves no room for the byte alphabet and the special tokens.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is below the {len(alphabet) + len(SPECIAL_TOKENS)} byte and special tokens"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=END,
        pad_token=PAD,
        extra_special_tokens=[SYSTEM, USER, ASSISTANT],
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )
