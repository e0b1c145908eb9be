"""JSON schemas for the structured-output tests: objects, nesting, arrays, enums, bounded
numbers, string patterns, $ref/$defs, optional fields. Sizes are bounded (maxLength, maxItems,
additionalProperties false) so a sampled output ends within the tests' max_tokens."""

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SHORT = {"type": "string", "maxLength": 16}


def obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": list(props) if required is None else required}


SCHEMAS = [
    obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"city": NAME, "country": NAME}),
    obj({"answer": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"score": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"temperature": {"type": "integer", "minimum": -50, "maximum": 50},
         "unit": {"enum": ["C", "F"]}}),
    obj({"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}}),
    obj({"numbers": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                "maximum": 99}, "maxItems": 5}}),
    obj({"user": obj({"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                      "name": NAME})}),
    obj({"point": obj({"x": {"type": "integer", "minimum": -10, "maximum": 10},
                       "y": {"type": "integer", "minimum": -10, "maximum": 10}})}),
    obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}),
    obj({"name": NAME, "nickname": SHORT}, required=["name"]),
    obj({"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
         "rating": {"type": "integer", "minimum": 1, "maximum": 5}}, required=["title"]),
    {"$defs": {"person": obj({"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 99}})},
     **obj({"author": {"$ref": "#/$defs/person"}})},
    {"$defs": {"item": obj({"sku": {"type": "string", "pattern": "^[A-Z][0-9]{3}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 9}})},
     **obj({"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1,
                      "maxItems": 2}})},
    obj({"status": {"const": "ok"}, "count": {"type": "integer", "minimum": 0,
                                              "maximum": 10}}),
    obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, SHORT]}}),
    obj({"weekday": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]},
         "busy": {"type": "boolean"}}),
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 6}, "minItems": 2,
     "maxItems": 4},
    {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
    {"enum": ["small", "medium", "large"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "string", "pattern": "^(yes|no)$"},
    obj({"a": obj({"b": obj({"c": {"type": "integer", "minimum": 0, "maximum": 3}})})}),
    obj({"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 2, "maxItems": 2}}}),
    obj({"ok": {"type": "boolean"}, "reason": SHORT}, required=["ok"]),
    obj({"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
         "currency": {"enum": ["USD", "EUR"]}}),
    obj({"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}, "active": {"type": "boolean"},
         "meta": obj({"level": {"enum": [1, 2, 3]}}, required=[])}, required=["id", "meta"]),
    obj({"nullable": {"type": ["integer", "null"], "minimum": 0, "maximum": 5}}),
    obj({"first": NAME, "last": NAME, "langs": {"type": "array", "items": {
        "enum": ["python", "c", "rust"]}, "maxItems": 3}},
        required=["first", "last"]),
]
