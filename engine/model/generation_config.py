"""A checkpoint's generation_config.json: read and checked at load, and the sampling defaults it sets (as vLLM
reads them) under our SamplingParams field names."""
from __future__ import annotations

import os
from typing import Any, Mapping

from engine.model.errors import CheckpointError, ConfigError, read_json_object as _read_json_object


# generation_config.json keys that become sampling defaults (as vLLM reads them) -> SamplingParams field
GENERATION_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(folder: str) -> dict:
    """The folder's generation_config.json as JSON ({} when absent), its eos_token_id and sampling defaults
    checked so that a bad value fails at load with the file and field named, not on every request."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    gen = _read_json_object(path)
    eos = gen.get("eos_token_id")
    if eos is not None and not (_is_int(eos) or (isinstance(eos, list) and all(_is_int(e) for e in eos))):
        raise CheckpointError(path, f"field 'eos_token_id'={eos!r} must be an integer or a list of integers")
    try:
        default_sampling(gen)
    except ConfigError as e:
        raise CheckpointError(path, str(e)) from None
    return gen


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def default_sampling(generation_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The sampling defaults a generation_config.json sets, as vLLM reads them: temperature, top_p, top_k, min_p,
    repetition_penalty and max_new_tokens, only those present (and not null), under our SamplingParams names
    (max_new_tokens -> max_tokens). A request's own values override them. Raises ConfigError for a value that
    SamplingParams would refuse."""
    out: dict[str, Any] = {}
    for key, name in GENERATION_SAMPLING_KEYS.items():
        value = (generation_config or {}).get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"generation_config field {key!r}={value!r} is not a number")
        if name in ("top_k", "max_tokens"):
            if value != int(value):
                raise ConfigError(f"generation_config field {key!r}={value!r} is not an integer")
            value = int(value)
        else:
            value = float(value)
        ok = {"temperature": value >= 0, "top_p": 0 < value <= 1, "top_k": value >= -1, "min_p": 0 <= value <= 1,
              "repetition_penalty": value > 0, "max_tokens": value >= 1}[name]
        if not ok:
            raise ConfigError(f"generation_config field {key!r}={value!r} is out of range")
        out[name] = value
    return out


# ---- where weights come from ---------------------------------------------------------------------------------
