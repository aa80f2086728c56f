"""Finding and loading the model's tokenizer.

The `.fgm` file carries no tokenizer (fastgemma ships `tokenizer.json` beside it), so the services look for one
next to the model file unless a path is given: `<model>.tokenizer.json`, then `tokenizer.json` in the model's
folder. Loading uses the Hugging Face `tokenizers` library (the file format is theirs).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from .files import read_regular_text


class TokenizerNotFound(FileNotFoundError):
    pass


def control_tokens(tokenizer: Tokenizer) -> dict[int, str]:
    """The tokenizer's control tokens, id -> text: its special added tokens (an added token that is not special,
    e.g. Gemma 3's whitespace runs, is text the tokenizer makes from text)."""
    return {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}


def find_tokenizer(model_path: str | Path, explicit: str | Path | None = None) -> Path:
    """The tokenizer.json to use for `model_path`; raises TokenizerNotFound naming every place looked at."""
    if explicit is not None:
        p = Path(explicit)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.exists():
            raise TokenizerNotFound(f"tokenizer file {p} does not exist")
        return p
    model = Path(model_path)
    candidates = [model.with_suffix(".tokenizer.json"), model.parent / "tokenizer.json"]
    for c in candidates:
        if c.exists():  # not is_file(): a FIFO or folder there is an error worth naming (load_tokenizer does)
            return c
    raise TokenizerNotFound(
        "no tokenizer found for " + str(model) + " (looked for " + ", ".join(str(c) for c in candidates)
        + "); pass --tokenizer PATH"
    )


def load_tokenizer(model_path: str | Path, explicit: str | Path | None = None) -> Tokenizer:
    path = find_tokenizer(model_path, explicit)
    try:
        text = read_regular_text(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load tokenizer {path}: {e}") from e
    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # the library raises plain Exception subclasses for malformed files
        raise ValueError(f"cannot load tokenizer {path}: {e}") from e
