"""``--set`` values as the benchmarks read them: JSON where the text parses as JSON, else the text itself."""

from __future__ import annotations

import json
from typing import Any


def setting_value(raw: str) -> Any:
    """``"4"`` -> 4, ``"true"`` -> True, ``"1e-3"`` -> 0.001, ``"float32"`` -> ``"float32"``."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw
