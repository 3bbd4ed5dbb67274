"""``vllm-kv plan --model``: a shipped preset or a config.json file, checked before planning.

A file must be a readable, UTF-8 JSON object of sane size and nesting; ``--tp`` must divide the
model's attention heads, as upstream vLLM requires. The planner bounds the integer keys it reads
as it reads them (a layer count of 10**12, a head size of 2**70; other keys, such as a
``quantization_config``, are never checked). Its errors name a library key (``config: ...``,
``block_size: ...``); :func:`planner_usage_error` names the flag.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm.cli.args import UsageError
from vllm.model_presets import available_presets
from vllm.v1.core.model_config import MAX_CONFIG_INT, load_model_config

MAX_CONFIG_BYTES = 16 * 2**20
"""Largest config file read (a real config.json is a few KiB)."""

_JSON_TYPE_NAMES = {list: "an array", str: "a string", int: "a number", float: "a number"}
_JSON_TYPE_NAMES |= {bool: "a boolean", type(None): "null"}

# The planner's error prefixes (its parameter names) -> the plan flag that sets them.
PLANNER_FLAGS = {
    "tensor_parallel_size": "--tp",
    "block_size": "--block-size",
    "max_model_len": "--max-model-len",
    "kv_cache_dtype_skip_layers": "--skip-layers",
    "available_memory": "--memory",
}


def load_model_argument(model: str) -> tuple[str, dict[str, Any]]:
    """``(display name, bare config)`` of ``--model``; :class:`UsageError` when it is neither a
    preset nor a sane config file."""
    if model in available_presets():
        return load_model_config(model)
    _check_json_object(model)
    # Checked: the library reads it again for its naming and preset-wrapper rules.
    try:
        return load_model_config(model)
    except ValueError as exc:
        raise planner_usage_error(exc, model) from None


def check_tp_fits_heads(config: Mapping[str, Any], tp: int, model: str) -> None:
    """``tp`` must divide the attention (query) heads; KV heads fewer than ``tp`` are
    replicated by the planner, as upstream vLLM does."""
    text_config = config.get("text_config")
    if "num_attention_heads" not in config and isinstance(text_config, Mapping):
        config = text_config
    heads = config.get("num_attention_heads")
    if isinstance(heads, bool) or not isinstance(heads, int) or not 0 < heads <= MAX_CONFIG_INT:
        return  # no attention heads to split (the planner reports the key)
    if heads % tp:
        raise UsageError(
            "--tp",
            f"expected a divisor of the {heads} attention heads of {model} (config "
            f"'num_attention_heads'; each rank holds an equal share), got {tp}",
        )


def planner_usage_error(exc: ValueError, model: str) -> UsageError:
    """The planner's ``ValueError`` as a :class:`UsageError` naming the flag behind it (the
    model for its config keys and anything else)."""
    prefix, _, rest = str(exc).partition(": ")
    flag = PLANNER_FLAGS.get(prefix)
    if flag is None:
        return UsageError("--model", f"{model}: {exc}")
    return UsageError(flag, rest)


def _check_json_object(model: str) -> None:
    """The file ``model`` holds a JSON object (a config.json)."""

    def bad(expected: str, why: str) -> UsageError:
        return UsageError("--model", f"expected {expected}, got {model!r} ({why})")

    if not model:
        raise UsageError("--model", "expected a preset name or a config.json path, got ''")
    path = Path(model)
    if not path.exists():
        raise bad(
            "a shipped preset or a config.json path",
            f"no such preset or file; available presets: {', '.join(available_presets())}",
        )
    if path.is_dir():
        raise bad("a config.json file", "a directory")
    if not path.is_file():
        raise bad("a config.json file", "not a regular file")
    try:
        with path.open("rb") as source:
            raw = source.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise bad("a readable config.json file", str(exc.strerror)) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise bad(f"a config.json of at most {MAX_CONFIG_BYTES // 2**20} MiB", "larger")
    if not raw.strip():
        raise bad("a JSON config file", "empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(
            "a UTF-8 JSON config file",
            f"byte 0x{raw[exc.start]:02x} at offset {exc.start} is not UTF-8; a binary file?",
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad(
            "a JSON config file", f"line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except (ValueError, RecursionError) as exc:  # a 5000-digit number, arrays nested too deep
        raise bad("a JSON config file", str(exc)) from None
    if not isinstance(data, dict):
        raise bad("a JSON object (a config.json)", _JSON_TYPE_NAMES[type(data)])
