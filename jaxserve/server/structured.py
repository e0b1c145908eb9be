"""Constraints over HTTP: OpenAI `response_format` and vLLM's `guided_*` / `structured_outputs`.

`constraint(f)` reads the request's constraint fields into one StructuredOutputs (or None) and
the name of the field it came from, for the 400 that names it. `check_compiles` compiles it in
the handler thread (through the engine's grammar pool and cache), so an invalid schema or regex
is a 400 before anything is queued, and the engine then finds the grammar compiled.
"""

from __future__ import annotations

from jaxserve.core.grammar import GrammarError
from jaxserve.core.strict_schema import close_objects
from jaxserve.core.sampling_params import SamplingParamError
from jaxserve.core.structured_outputs import StructuredOutputs
from jaxserve.server.errors import invalid, shown
from jaxserve.server.fields import Fields

COMPILE_TIMEOUT_S = 60.0
# vLLM's extra fields -> StructuredOutputs' own names.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
SPEC_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


def constraint(f: Fields) -> tuple[StructuredOutputs | None, str | None]:
    """(the request's constraint, the field it came from); a 400 when malformed or when two
    fields ask for constraints."""
    found = []
    fmt = _response_format(f.raw("response_format"))
    if fmt is not None:
        found.append(("response_format", fmt))
    for name, kind in GUIDED.items():
        value = f.raw(name)
        if value is not None:
            found.append((name, {kind: value}))
    so = f.raw("structured_outputs")
    if so is not None:
        if not isinstance(so, dict) or not set(so) <= set(SPEC_FIELDS):
            raise invalid(f"'structured_outputs' must be an object with one of "
                          f"{', '.join(SPEC_FIELDS)}", "structured_outputs")
        found.append(("structured_outputs", so))
    if not found:
        return None, None
    if len(found) > 1:
        raise invalid(f"give one constraint, got {', '.join(n for n, _ in found)}", found[1][0])
    name, kwargs = found[0]
    try:
        return StructuredOutputs(**kwargs), name
    except SamplingParamError as e:
        raise invalid(f"'{name}': {e}", name) from None


def _response_format(fmt) -> dict | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise invalid("response_format json_schema needs 'json_schema': {'name': ..., "
                          "'schema': {...}}", "response_format")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise invalid(f"json_schema.name must be a string, got {shown(name)}",
                          "response_format")
        strict = spec.get("strict")
        if not isinstance(strict, bool | None):
            raise invalid(f"json_schema.strict must be a boolean, got {shown(strict)}",
                          "response_format")
        # Either way the output follows the schema (the grammar cannot do less); strict mode
        # also reads objects that leave additionalProperties unsaid as closed, as OpenAI does.
        schema = spec.get("schema", {})
        return {"json": close_objects(schema) if strict else schema}
    raise invalid(f"response_format type must be 'text', 'json_object' or 'json_schema', got "
                  f"{shown(kind)}", "response_format")


def check_compiles(grammar, spec: StructuredOutputs, param: str) -> None:
    """Compiles `spec` now (off the engine thread) or raises the 400 naming `param`."""
    if grammar is None:
        raise invalid("this server does not serve structured outputs (started with "
                      "--no-structured-outputs, or the model has no tokenizer)", param,
                      "unsupported")
    try:
        grammar.compile(spec, timeout=COMPILE_TIMEOUT_S)
    except GrammarError as e:
        raise invalid(f"'{param}': {str(e)[:500]}", param, "invalid_constraint") from None
    except TimeoutError:
        raise invalid(f"'{param}': the constraint did not compile within "
                      f"{COMPILE_TIMEOUT_S:.0f} s", param, "invalid_constraint") from None
