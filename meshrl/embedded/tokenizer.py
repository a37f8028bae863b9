"""A character-level tokenizer built in code, so the embedded default needs no download.

One token per printable ASCII character plus four specials (``<pad>``, ``<eos>``, ``<unk>``,
``<bos>``), built with the `tokenizers` library and wrapped as a transformers fast tokenizer:
``save_pretrained`` / ``AutoTokenizer.from_pretrained`` work on it like on any hub tokenizer.

The vocabulary is spelled in GPT-2's byte-level alphabet (space is ``Ġ``, newline ``Ċ``, tab
``ĉ``; the other printable characters are themselves), with a byte-level pre-tokenizer and
decoder. transformers 5 loads a Qwen2 model directory's tokenizer as ``Qwen2Tokenizer``, which
keeps the vocabulary but imposes its own byte-level pre-tokenizer: with plain ``" "`` tokens,
every whitespace character was silently dropped on load (``"2 + 3"`` became ``"2+3"``). Spelled
this way, both readings give the same ids.

Simplification: characters outside printable ASCII map to ``<unk>`` (one per UTF-8 byte); the
small models of the embedded default never need more.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>", "<bos>")
CHARACTERS = tuple(c for c in string.printable if c not in "\r\x0b\x0c")
_BYTE_LEVEL = {" ": "\u0120", "\n": "\u010a", "\t": "\u0109"}  # GPT-2's bytes_to_unicode for the rest: identity

__all__ = ["build_char_tokenizer", "SPECIAL_TOKENS", "CHARACTERS"]


def build_char_tokenizer(vocab_size: int | None = None, characters: str | None = None) -> PreTrainedTokenizerFast:
    """The embedded default's tokenizer: ids 0–3 are the specials, then one id per character.

    ``characters``: only these characters (in this order), e.g. ``"0123456789+="`` for a 16-token
    vocabulary that spells addition; any other character encodes as ``<unk>``. Default: printable ASCII.
    ``vocab_size``: pad the vocabulary with filler tokens ``<|i|>`` up to this many ids, so a model
    with a real vocabulary's shape (e.g. Qwen2.5's 151,936) decodes every id it samples to text;
    text is still encoded one character per token (a filler is never produced by encoding).
    """
    chars = CHARACTERS if characters is None else tuple(dict.fromkeys(characters))
    if not chars:
        raise ValueError("characters must name at least one character")
    base = SPECIAL_TOKENS + tuple(_BYTE_LEVEL.get(c, c) for c in chars)
    if vocab_size is not None and vocab_size < len(base):
        raise ValueError(f"vocab_size must be >= {len(base)} (the specials and characters), got {vocab_size}")
    fillers = tuple(f"<|{i}|>" for i in range(len(base), vocab_size or len(base)))
    vocab = {tok: i for i, tok in enumerate(base + fillers)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Text to byte-level characters, then every character its own pre-token, which WordLevel maps to its id.
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"),
    ])
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        bos_token="<bos>",
        model_max_length=4096,
    )
