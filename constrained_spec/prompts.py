"""Turning a user prompt + schema into the token ids the model sees.

String prompts go through the model's chat template with the schema described in a system
message (``system_prompt=None``: our default text; a string: yours, used as is; ``False``: no
system message). A list of chat messages is used as given (a content that is a list of
OpenAI-style text parts is joined), with our system message put in front unless one is
already there or ``system_prompt=False``. Text that is not Unicode (lone surrogates) or
content that is not text is a `ConfigError` naming ``prompt`` / ``system_prompt``.
"""

from __future__ import annotations

import json
from typing import Any

from constrained_spec.schemas import SchemaSpec
from constrained_spec.schemas.spec import lone_surrogate

from .errors import ConfigError

Messages = list[dict[str, str]]


def describe_schema(spec: SchemaSpec | None) -> str | None:
    """The default system message for a spec: what to answer and in which shape."""
    if spec is None:
        return None
    if spec.kind == "json_schema":
        schema = json.dumps(spec.json_schema, ensure_ascii=False)
        guide = _field_guide(spec.json_schema or {})
        text = ("Answer with a JSON object that follows this JSON Schema, and nothing else.\n"
                f"JSON Schema: {schema}")
        return text + (f"\nFields:\n{guide}" if guide else "")
    if spec.kind == "regex":
        return f"Answer with text that matches this regular expression, and nothing else: {spec.regex}"
    if spec.kind == "choice":
        return "Answer with exactly one of these options, and nothing else: " + ", ".join(spec.choices)
    return f"Answer with text that follows this grammar (EBNF), and nothing else:\n{spec.ebnf}"


def _field_guide(schema: dict[str, Any]) -> str:
    """One line per top-level property that has a title or description."""
    lines = []
    for name, sub in (schema.get("properties") or {}).items():
        if not isinstance(sub, dict):
            continue
        text = sub.get("description") or sub.get("title")
        if text and text != name:
            lines.append(f"- {name}: {text}")
    return "\n".join(lines)


def check_text(text: str, option: str, what: str | None = None) -> None:
    """Raise `ConfigError` naming `option` if `text` is not Unicode text (a lone surrogate, e.g.
    from bytes decoded with ``surrogateescape``): no tokenizer can encode it."""
    bad = lone_surrogate(text)
    if bad is not None:
        raise ConfigError(f"{what or 'the text'} has a lone surrogate ({bad}), which is not "
                          "Unicode text (it cannot be written as UTF-8): fix the encoding of the "
                          "input", option=option)


def _message_content(content: Any, i: int) -> str:
    """A message's content as text: a string, or OpenAI's list of text parts joined."""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                got = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ConfigError(f"message {i}, content part {j}: only text parts "
                                  f"{{'type': 'text', 'text': ...}} are supported, got {got!r:.40}",
                                  option="prompt")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ConfigError(f"message {i}: content must be a string or a list of text parts, got "
                          f"{type(content).__name__}", option="prompt")
    check_text(content, "prompt", f"message {i}")
    return content


def build_messages(prompt: str | Messages, spec: SchemaSpec | None,
                   system_prompt: str | bool | None = None) -> Messages:
    if isinstance(prompt, str):
        check_text(prompt, "prompt", "the prompt")
        messages: Messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m
                                          for m in prompt):
        messages = []
        for i, m in enumerate(prompt):
            if not isinstance(m["role"], str):
                raise ConfigError(f"message {i}: role must be a string, got "
                                  f"{type(m['role']).__name__}", option="prompt")
            check_text(m["role"], "prompt", f"message {i}'s role")
            messages.append({**m, "content": _message_content(m["content"], i)})
    else:
        raise ConfigError("a prompt is a string or a list of {'role', 'content'} messages",
                          option="prompt")
    if not messages or not any(m["role"] == "user" for m in messages):
        raise ConfigError("the conversation has no user message", option="prompt")
    if system_prompt is False:
        return messages
    if isinstance(system_prompt, str):
        check_text(system_prompt, "system_prompt", "the system prompt")
    text = system_prompt if isinstance(system_prompt, str) else describe_schema(spec)
    if text and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": text})
    return messages


def encode_prompt(tokenizer: Any, prompt: str | Messages, spec: SchemaSpec | None,
                  system_prompt: str | bool | None = None) -> list[int]:
    """Token ids of the full model input, generation prompt included."""
    messages = build_messages(prompt, spec, system_prompt)
    if isinstance(prompt, str) and not prompt.strip():
        raise ConfigError("the prompt is empty", option="prompt")
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        text = "\n\n".join(m["content"] for m in messages) + "\n"
        ids = tokenizer.encode(text)
    return list(ids)
