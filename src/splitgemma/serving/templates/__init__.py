"""Chat templates built in for model families whose models may ship none (a base model's checkpoint has no
template). Used only when neither --chat-template nor the model's own files give one (services/gateway/server.py).
"""

from __future__ import annotations

from importlib.resources import files

# The .fgm header's config.model_type → the template file here. Gemma 4 headers carry no model_type, and Gemma 4's
# turn format has no published standalone template: no entry.
_BY_MODEL_TYPE = {"gemma3": "gemma3.jinja", "gemma3_text": "gemma3.jinja"}


def builtin_chat_template(model_type: str | None) -> tuple[str, str] | None:
    """(template source, its name as /v1/models shows it) for the family of `model_type`, or None."""
    name = _BY_MODEL_TYPE.get(model_type or "")
    if name is None:
        return None
    return (files(__package__) / name).read_text(encoding="utf-8"), f"built-in:{name.removesuffix('.jinja')}"
