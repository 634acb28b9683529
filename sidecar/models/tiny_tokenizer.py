"""The tiny pair's tokenizer: a small BPE trained on the fly, which both its models share (tests, benchmarks).

Apart from the tiny models, so that counting its tokens (a sharded run's parent cuts its shards by them) loads no
torch: transformers' fast tokenizer class does not import it, the models do (seconds)."""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TINY_CORPUS = (
    "The city council approved a new budget on Tuesday after a long debate about schools, roads and "
    "public health. Officials said the plan would add jobs at the plant in the north of the state. "
    "Summarize the document in 3 bullets. Keep each bullet under 18 words. Then output 3-5 short "
    "hashtags for the summary. #news #politics #economy #health #climate #sports #technology "
    "You are a concise assistant. The president met leaders in Berlin, Moscow, Beijing and Doha. "
    "Prices rose 3.5 percent in 2017 while 1,200 workers lost their jobs at the factory. "
)


SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@cache
def _trained() -> Tokenizer:
    """The BPE itself, with the ``tokenizers`` library alone: transformers takes most of a second to import."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # as Qwen2's tokenizer: text is NFC-normalised before it is split, so a token's text need not be the input's
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TINY_CORPUS] * 4, trainer=trainer)
    return tok


def tiny_vocab_size() -> int:
    """How many tokens the tiny tokenizer has (``len(tiny_tokenizer())``), without importing transformers."""
    return _trained().get_vocab_size(with_added_tokens=True)


@cache
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=_trained(), eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=list(SPECIALS[1:]))
    fast.chat_template = CHATML_TEMPLATE
    return fast
