"""The model's recommended sampling: the defaults a request's unset sampling fields take.

A checkpoint's generation_config.json says how its makers sample it (Google recommends temperature 1.0, top_p 0.95
and top_k 64 for Gemma 4). As vLLM does (`--generation-config auto`), the gateway takes temperature, top_p,
top_k, min_p and repetition_penalty from it as the defaults of every completion, chat and response; a request that
sets a field overrides it. `none` keeps OpenAI's defaults (temperature 1, no cut); a path names another
generation_config.json (or the folder holding one). Other keys (do_sample, max_new_tokens, eos_token_id: the
stop tokens are read in stop_tokens.py) are not sampling defaults here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

from .files import read_regular_text

FILE = "generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    """None: the API's own default (temperature 1, top_p 1, no top_k / min_p / repetition penalty)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    source: str = ""   # where they came from, for the gateway's log

    def given(self) -> dict:
        """The defaults that are set, by field name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "source" and getattr(self, f.name) is not None}


# field -> (is it an integer, its check, what the check says)
_RULES = {
    "temperature": (False, lambda v: v >= 0, "at least 0"),
    "top_p": (False, lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (True, lambda v: v >= 0, "at least 0 (0: no cut)"),
    "min_p": (False, lambda v: 0 <= v <= 1, "in [0, 1]"),
    "repetition_penalty": (False, lambda v: v > 0, "above 0"),
}


class GenerationConfigError(ValueError):
    """A generation config that cannot be used: the message names the file and the key."""


def load_sampling_defaults(spec: str, model_path: str | None) -> SamplingDefaults:
    """`spec`: "auto" (generation_config.json beside the model, if there is one), "none", or a path (a
    generation_config.json, or a folder with one: it must exist)."""
    if spec == "none":
        return SamplingDefaults()
    if spec == "auto":
        if model_path is None:
            return SamplingDefaults()
        path = Path(model_path).parent / FILE
        if not path.exists():
            return SamplingDefaults()
    else:
        path = Path(spec)
        if path.is_dir():
            path = path / FILE
    try:
        config = json.loads(read_regular_text(path))
    except OSError as e:
        raise GenerationConfigError(f"cannot read the generation config {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise GenerationConfigError(f"the generation config {path} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise GenerationConfigError(f"the generation config {path} is not a JSON object")
    values = {}
    for key, (integer, ok, what) in _RULES.items():
        v = config.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)) or \
                not math.isfinite(v) or not ok(v):
            raise GenerationConfigError(f"the generation config {path}: {key} must be "
                                        f"{'an integer ' if integer else 'a number '}{what}, got {v!r}")
        values[key] = int(v) if integer else float(v)
    return SamplingDefaults(**values, source=str(path))
