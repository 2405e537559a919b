"""Bounds on forced tool arguments, so a weak model cannot spin inside one number until the token limit.

A JSON Schema ``integer`` or ``number`` with no bound lets a grammar-forced model write digits
forever (seen: ``"days": 642333333...`` until max_tokens). ``bounded_numbers`` adds what the
schema leaves open, and llguidance enforces it in the grammar:

- integers: at most ``MAX_INTEGER_DIGITS`` digits (``minimum`` / ``maximum`` of +-(10^15 - 1));
- numbers: the same integer part, at most ``MAX_FRACTION_DIGITS`` decimals (``multipleOf``
  10^-9), no exponent (llguidance writes bounded numbers in plain decimal notation).

A side the schema already bounds is kept; a schema with its own ``multipleOf`` keeps it. Strings
are not bounded (tool arguments carry code and documents of any length): a model looping in one
is cut off by max_tokens and reported as a truncated call. The transformed schema only builds the
grammar; the tool definition the model sees and the client's schema are unchanged.
"""

from __future__ import annotations

from typing import Any

MAX_INTEGER_DIGITS = 15  # every value a client can send as an IEEE double exactly (2^53 has 16)
MAX_FRACTION_DIGITS = 9
LIMIT = 10**MAX_INTEGER_DIGITS - 1
FRACTION_STEP = float(f"1e-{MAX_FRACTION_DIGITS}")  # not 10.0**-9, which is 1.0000000000000001e-09
# keywords whose values are data, not schemas; and those whose values map names to schemas
_DATA_KEYWORDS = ("const", "enum", "default", "examples", "required")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bounded_numbers(schema: Any) -> Any:
    """A copy of ``schema`` where every integer or number schema has both bounds (see the module
    docstring); anything else is unchanged."""
    if isinstance(schema, list):
        return [bounded_numbers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: bounded_numbers(s) for name, s in value.items()}
        else:
            out[key] = value if key in _DATA_KEYWORDS else bounded_numbers(value)
    types = out.get("type")
    types = [types] if isinstance(types, str) else (types if isinstance(types, list) else [])
    if "integer" in types or "number" in types:
        _bound(out, low=("minimum", "exclusiveMinimum"), high=("maximum", "exclusiveMaximum"))
        if "number" in types and "multipleOf" not in out:
            out["multipleOf"] = FRACTION_STEP
    return out


def _bound(schema: dict, low: tuple[str, str], high: tuple[str, str]) -> None:
    lows = [schema[k] for k in low if isinstance(schema.get(k), (int, float))]
    highs = [schema[k] for k in high if isinstance(schema.get(k), (int, float))]
    # a side is added only when it leaves the range non-empty (a schema asking for huge values gets them)
    if not lows and all(h >= -LIMIT for h in highs):
        schema["minimum"] = -LIMIT
    if not highs and all(lo <= LIMIT for lo in lows):
        schema["maximum"] = LIMIT
