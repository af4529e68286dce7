"""A small JSON-schema validator for tool arguments.

Supported: type (object, string, integer, number, boolean, array, null, or a list of them), properties,
required, enum, additionalProperties (false or a schema), items, minimum/maximum, minLength/maxLength,
minItems/maxItems. Anything else in a schema is ignored (documented simplification): tool schemas
we see in practice use only this subset. Errors are short sentences meant for the model to read.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def validate(value: Any, schema: dict[str, Any], path: str = "arguments") -> list[str]:
    """Problems of `value` against `schema`, as messages; empty when valid."""
    errors: list[str] = []
    typ = schema.get("type")
    if typ is not None:
        types = typ if isinstance(typ, list) else [typ]
        if not any(_TYPES.get(t, lambda v: True)(value) for t in types):
            return [f"{path} must be of type {' or '.join(types)}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path} must be one of {schema['enum']!r}, got {value!r}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path} is missing required property {key!r}")
        extra = schema.get("additionalProperties", True)
        for key, v in value.items():
            if key in props:
                errors.extend(validate(v, props[key], f"{path}.{key}"))
            elif extra is False:
                errors.append(f"{path} has unexpected property {key!r} (allowed: {sorted(props)})")
            elif isinstance(extra, dict):
                errors.extend(validate(v, extra, f"{path}.{key}"))
    elif isinstance(value, list):
        if "items" in schema and isinstance(schema["items"], dict):
            for i, v in enumerate(value):
                errors.extend(validate(v, schema["items"], f"{path}[{i}]"))
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(f"{path} needs at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path} takes at most {schema['maxItems']} items")
    elif isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{path} must be at least {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path} must be at most {schema['maxLength']} characters")
    elif _TYPES["number"](value):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path} must be >= {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path} must be <= {schema['maximum']}")
    return errors
