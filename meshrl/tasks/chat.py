"""Prompts for chat models: render messages with the model tokenizer's chat template, once, at start.

A prompt file's prompt may be a string or a list of chat messages (``{"role": ..., "content": ...}``,
as in OpenAI's and Hugging Face's chat formats). ``task.chat_template`` decides what reaches the
engine:

- null (the default): messages are rendered with the tokenizer's template (``add_generation_prompt``:
  the text ends where the assistant's reply begins); strings are used as they are (base models,
  or prompts rendered by hand);
- true: every prompt is rendered, a string as one user turn (the way instruct models expect
  GSM8K-style questions), after ``task.system_prompt`` when set (messages that begin with their
  own system turn keep theirs);
- false: prompts are used as they are, and messages are refused.

Rendering happens once when the task is built. ``Problem.prompt`` stays a string, so rollout,
evaluation, reward models and the start-up checks tokenize it as before; a resume compares the
prompts as written (``source_split``), since a template may render today's date. A template that writes
the BOS token itself (Llama 3's does) would get a second one from a tokenizer that also adds it
when encoding; the rendered text drops the template's copy in that case.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ChatRenderer", "check_messages"]


def check_messages(prompt: Any, where: str, key: str) -> list[dict[str, str]]:
    """``prompt`` as a list of ``{"role", "content"}`` messages, or ``ValueError`` naming ``where``."""
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{where}: field {key!r} must be a non-blank string or a non-empty list of chat messages")
    for i, m in enumerate(prompt):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: field {key!r}, message {i}: expected {{\"role\": str, \"content\": str}}, "
                             f"got {m!r:.80}")
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


class ChatRenderer:
    """Renders prompts (strings or messages) with ``tokenizer``'s chat template (module docstring)."""

    def __init__(self, tokenizer: Any, *, system_prompt: str | None = None, source: str = ""):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"`task.chat_template`: the tokenizer{' of ' + source if source else ''} has no chat "
                             "template, so prompts cannot be rendered as chat (give prompts as strings with "
                             "task.chat_template=false or null, or use a chat model's tokenizer)")
        self.tokenizer, self.system_prompt = tokenizer, system_prompt
        bos = getattr(tokenizer, "bos_token", None)
        adds_bos = bool(bos) and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]
        self._drop = bos if adds_bos else None

    def __call__(self, prompt: str | list[dict[str, str]]) -> str:
        """The model's text for ``prompt``: messages, or a string as one user turn."""
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if self.system_prompt is not None and prompt[0]["role"] != "system":
            prompt = [{"role": "system", "content": self.system_prompt}, *prompt]
        text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        if self._drop and text.startswith(self._drop):
            text = text[len(self._drop):]
        return text
