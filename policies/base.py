"""The base of every policy model: unknown keys are an error with a did-you-mean hint."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from .values import fail, show, suggest


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, use_attribute_docstrings=True
    )
    _hints: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            names = [f.alias or n for n, f in cls.model_fields.items()]
            allowed = set(names) | set(cls.model_fields)
            for key in data:
                if key not in allowed:
                    hint = (
                        f" (write it as {cls._hints[key]!r})"
                        if key in cls._hints
                        else suggest(key, names)
                    )
                    fail(f"unknown field {show(key)}{hint}", key, key=True)
        elif not isinstance(data, BaseModel):
            fail(f"expected a mapping, got {show(data)}")
        return data
