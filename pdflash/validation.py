"""Input checks shared by the services (field violations, never exceptions of their own)."""

from __future__ import annotations

import math

from pdflash.errors import FieldViolation
from pdflash.types import SamplingParams

MAX_ID_CHARS = 256  # request, session and ticket ids: logged, some echoed as metadata


def id_violations(fields: dict[str, str]) -> list[FieldViolation]:
    """Ids (by field name) longer than MAX_ID_CHARS."""
    return [FieldViolation(k, f"{len(v)} characters; at most {MAX_ID_CHARS}") for k, v in fields.items() if len(v) > MAX_ID_CHARS]


def sampling_violations(s: SamplingParams, prefix: str = "sampling") -> list[FieldViolation]:
    v = []
    if math.isnan(s.temperature) or not (s.temperature == 0.0 or 0.0 < s.temperature <= 100.0):
        v.append(FieldViolation(f"{prefix}.temperature", f"must be 0 (greedy) or in (0, 100], got {s.temperature}"))
    if math.isnan(s.top_p) or not 0.0 < s.top_p <= 1.0:
        v.append(FieldViolation(f"{prefix}.top_p", f"must be in (0, 1] (0 means off), got {s.top_p}"))
    if s.top_k < 0:
        v.append(FieldViolation(f"{prefix}.top_k", f"must be >= 0 (0 means off), got {s.top_k}"))
    return v
