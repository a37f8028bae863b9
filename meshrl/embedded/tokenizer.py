"""A character-level tokenizer built in code, so the embedded default needs no download.

One token per printable ASCII character plus four specials (``<pad>``, ``<eos>``, ``<unk>``,
``<bos>``), built with the `tokenizers` library and wrapped as a transformers fast tokenizer:
``save_pretrained`` / ``AutoTokenizer.from_pretrained`` work on it like on any hub tokenizer.

Simplification: characters outside printable ASCII map to ``<unk>``; the small models of the
embedded default never need more.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>", "<bos>")
CHARACTERS = tuple(c for c in string.printable if c not in "\r\x0b\x0c")

__all__ = ["build_char_tokenizer", "SPECIAL_TOKENS", "CHARACTERS"]


def build_char_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """The embedded default's tokenizer: ids 0–3 are the specials, then one id per character.

    ``vocab_size``: pad the vocabulary with filler tokens ``<|i|>`` up to this many ids, so a model
    with a real vocabulary's shape (e.g. Qwen2.5's 151,936) decodes every id it samples to text;
    text is still encoded one character per token (a filler is never produced by encoding).
    """
    base = SPECIAL_TOKENS + CHARACTERS
    if vocab_size is not None and vocab_size < len(base):
        raise ValueError(f"vocab_size must be >= {len(base)} (the specials and characters), got {vocab_size}")
    fillers = tuple(f"<|{i}|>" for i in range(len(base), vocab_size or len(base)))
    vocab = {tok: i for i, tok in enumerate(base + fillers)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Every character is its own pre-token; WordLevel then maps it to its id.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        bos_token="<bos>",
        model_max_length=4096,
    )
