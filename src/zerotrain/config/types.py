"""Field types shared by the config schema.

JSON configs in the wild write integers as floats (``"reduce_bucket_size": 5e8``), so integer
fields accept floats with no fractional part. Everything else is strict: ``"true"`` is not a
boolean and ``"1e-3"`` is not a number, because silently coercing them hides typos.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
)


def _integral_float_to_int(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[StrictInt, BeforeValidator(_integral_float_to_int)]
PositiveInt = Annotated[Int, Field(ge=1)]
NonNegativeInt = Annotated[Int, Field(ge=0)]
Float = Annotated[StrictFloat, Field(allow_inf_nan=False)]
NonNegativeFloat = Annotated[Float, Field(ge=0)]
PositiveFloat = Annotated[Float, Field(gt=0)]
Probability = Annotated[Float, Field(ge=0, lt=1)]
UnitFraction = Annotated[Float, Field(gt=0, le=1)]
Bool = StrictBool


class Section(BaseModel):
    """Base for every config section: unknown keys are errors and values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=False)


class LooseSection(BaseModel):
    """A section for a feature zerotrain does not implement: contents are kept, not checked.

    Enabling such a feature is reported as "not implemented yet" by ``features.py``; while it
    is disabled its contents have no effect, so validating them would only reject configs
    that work.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    enabled: Bool | None = None
