"""A flow whose parameters are a pydantic model's fields, each at the top level.

Prefect merges a run's parameters into its deployment's one top-level name at a time, and renders its run form
one top-level parameter at a time; a single model-valued parameter would be replaced whole by any override
(a run given ``{"params": {"limit": 4}}`` loses every other default of the deployment). So the flow function
takes ``**fields`` and :func:`takes_fields_of` gives it the model's fields as keyword parameters: their types with
their constraints (the JSON schema the UI's form and the API's validation use), their defaults, and their
descriptions as the docstring's ``Args`` (where Prefect reads a parameter's description from). The model stays
the one place a field is declared; the flow validates its arguments with it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel

F = TypeVar("F", bound=Callable[..., Any])


def takes_fields_of(model: type[BaseModel]) -> Callable[[F], F]:
    """Give the decorated ``fn(**fields)`` the signature and parameter docs of ``model``'s fields."""

    def apply(fn: F) -> F:
        parameters = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                              default=field.get_default(call_default_factory=True),
                              annotation=Annotated[field.annotation, *field.metadata] if field.metadata
                              else field.annotation)
            for name, field in model.model_fields.items()]
        fn.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        args = "".join(f"    {name}: {field.description}\n" for name, field in model.model_fields.items()
                       if field.description)
        fn.__doc__ = f"{inspect.cleandoc(fn.__doc__ or '')}\n\nArgs:\n{args}"
        return fn

    return apply
