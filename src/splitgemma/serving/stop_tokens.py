"""The model's stop tokens, for every place that generates (decode worker, splitgemma generate).

The `.fgm` carries no stop tokens; like transformers, we take them from the files that sit beside the model.
"""

from __future__ import annotations

import json
from pathlib import Path

from .files import read_regular_text

# <eos>, <turn|> (end of turn) and <|tool_response> (the model hands over to a tool): generation_config.json of the
# released Gemma 4 checkpoints.
GEMMA4_STOP_TOKENS = (1, 106, 50)


def model_stop_tokens(model_path: str) -> tuple[tuple[int, ...], str]:
    """The model's stop token ids and where they came from: eos_token_id of generation_config.json, else of
    config.json (top level or text_config) beside the model file, else Gemma 4's."""
    folder = Path(model_path).parent
    for name in ("generation_config.json", "config.json"):
        f = folder / name
        try:
            cfg = json.loads(read_regular_text(f))
        except (OSError, ValueError):
            continue
        for c in (cfg, cfg.get("text_config") or {}):
            eos = c.get("eos_token_id") if isinstance(c, dict) else None
            if isinstance(eos, int):
                eos = [eos]
            if isinstance(eos, list) and eos and all(isinstance(t, int) and t >= 0 for t in eos):
                return tuple(eos), str(f)
    return GEMMA4_STOP_TOKENS, "Gemma 4 default"
