"""The jsonschema validator final validation uses, in a module of its own.

Kept apart from `validate` (which parses outputs into the user's types) so that the backend
rewrites (`backends.all_of_values`) can evaluate subschemas with exactly the validator final
validation uses, without importing the output-parsing layer: it depends only on `refs` and
`formats`, neither of which imports anything that imports this.
"""

from __future__ import annotations

from typing import Any

from .formats import format_checker
from .refs import validator, validator_class

__all__ = ["json_validator"]


def json_validator(schema: dict) -> Any:
    """The jsonschema validator final validation uses: the schema's ``$schema`` draft (default
    2020-12) with format checking, including the formats of `formats.FORMAT_CHECKS`."""
    cls = validator_class(schema)
    # references resolve inside the schema only (refs.py): jsonschema never fetches one
    return validator(schema, cls=cls, format_checker=format_checker(cls))
