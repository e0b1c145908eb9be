"""Strict-mode JSON schemas: objects that do not say `additionalProperties` are closed.

JSON Schema leaves an object open unless it says otherwise, and a grammar that follows it lets
a model add properties the schema never named, at temperature 0 too, until max_tokens. OpenAI's
strict mode (`response_format` `json_schema` with `strict: true`, and tool parameters) reads
such an object as closed, and so does vLLM's xgrammar backend by default. `close_objects` makes
that explicit before the schema reaches the grammar engine.

An object schema is a node with `type` "object" (alone or in a list) or with `properties`,
`required` or `patternProperties`; one that states `additionalProperties` (true, false or a
schema) or `unevaluatedProperties` keeps it. The walk goes through `properties`,
`patternProperties`, `additionalProperties`, `items`, `prefixItems`, `contains`, `anyOf`,
`oneOf`, `not`, `if`/`then`/`else`, `$defs` and `definitions`. `allOf` members describe parts
of one object, so neither they nor the node holding them are closed (closing each part would
refuse the other parts' properties); what lies inside them is.
"""

from __future__ import annotations

_CHILD_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_CHILD_SCHEMAS = ("additionalProperties", "items", "contains", "not", "if", "then", "else",
                  "unevaluatedItems")
_CHILD_LISTS = ("prefixItems", "anyOf", "oneOf")


def close_objects(schema):
    """A copy of `schema` with every object schema that leaves `additionalProperties`
    unsaid closed (`"additionalProperties": false`); `schema` itself is not changed."""
    out = _tree(schema)
    _close(out, closable=True)
    return out


def _tree(node):
    """A copy in which no dict or list is shared (deepcopy would keep a subschema used twice
    shared, and closing it in one place would close it in the other)."""
    if isinstance(node, dict):
        return {k: _tree(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_tree(v) for v in node]
    return node


def _is_object(node: dict) -> bool:
    kind = node.get("type")
    if kind == "object" or (isinstance(kind, list) and "object" in kind):
        return True
    return any(k in node for k in ("properties", "required", "patternProperties"))


def _close(node, closable: bool) -> None:
    if not isinstance(node, dict):
        return  # true / false schemas, or a malformed node the grammar engine will refuse
    parts = node.get("allOf")
    if closable and parts is None and _is_object(node) and \
            "additionalProperties" not in node and "unevaluatedProperties" not in node:
        node["additionalProperties"] = False
    for key in _CHILD_MAPS:
        children = node.get(key)
        if isinstance(children, dict):
            for child in children.values():
                _close(child, closable=True)
    for key in _CHILD_SCHEMAS:
        _close(node.get(key), closable=True)
    if isinstance(node.get("items"), list):  # draft-07 tuple form
        for child in node["items"]:
            _close(child, closable=True)
    for key in _CHILD_LISTS:
        if isinstance(node.get(key), list):
            for child in node[key]:
                _close(child, closable=True)
    if isinstance(parts, list):
        for child in parts:
            _close(child, closable=False)
