"""Turning a user prompt + schema into the token ids the model sees.

String prompts go through the model's chat template with the schema described in a system
message (``system_prompt=None``: our default text; a string: yours, used as is; ``False``: no
system message). A list of chat messages is used as given, with our system message put in
front unless one is already there or ``system_prompt=False``.
"""

from __future__ import annotations

import json
from typing import Any

from constrained_spec.schemas import SchemaSpec

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


def build_messages(prompt: str | Messages, spec: SchemaSpec | None,
                   system_prompt: str | bool | None = None) -> Messages:
    if isinstance(prompt, str):
        messages: Messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m
                                          for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise ConfigError("a prompt is a string or a list of {'role', 'content'} messages",
                          option="prompt")
    if not messages or not any(m["role"] == "user" for m in messages):
        raise ConfigError("the conversation has no user message", option="prompt")
    if system_prompt is False:
        return messages
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
