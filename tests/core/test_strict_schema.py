"""close_objects (core/strict_schema.py), judged by jsonschema: strict mode refuses properties
a schema never named, everywhere objects can appear, and changes nothing else."""

import copy

import jsonschema
import pytest

from jaxserve.core.strict_schema import close_objects

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
SCHEMAS = {  # name: (schema, an instance with an unnamed property, the same without it)
    "top": (PERSON, {"name": "a", "x": 1}, {"name": "a"}),
    "nested": ({"type": "object", "properties": {"p": PERSON}},
               {"p": {"name": "a", "x": 1}}, {"p": {"name": "a"}}),
    "ref": ({"$defs": {"p": PERSON}, "type": "object",
             "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#/$defs/p"}},
             "required": ["a", "b"]},
            {"a": {"name": "a"}, "b": {"name": "b", "x": 1}},
            {"a": {"name": "a"}, "b": {"name": "b"}}),
    "array-items": ({"type": "array", "items": PERSON}, [{"name": "a"}, {"name": "b", "x": 1}],
                    [{"name": "a"}, {"name": "b"}]),
    "prefix-items": ({"type": "array", "prefixItems": [PERSON]}, [{"name": "a", "x": 1}],
                     [{"name": "a"}]),
    "nullable-anyof": ({"anyOf": [PERSON, {"type": "null"}]}, {"name": "a", "x": 1},
                       {"name": "a"}),
    "type-list": ({"type": ["object", "null"], "properties": {"n": {"type": "integer"}}},
                  {"n": 1, "x": 1}, {"n": 1}),
    "map-values": ({"type": "object", "additionalProperties": PERSON},
                   {"k": {"name": "a", "x": 1}}, {"k": {"name": "a"}, "j": {"name": "b"}}),
    "no-properties": ({"type": "object"}, {"x": 1}, {}),
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_closed_refuses_unnamed_properties_open_keeps_them(name):
    schema, extra, plain = SCHEMAS[name]
    before = copy.deepcopy(schema)
    closed = close_objects(schema)
    assert schema == before  # the caller's schema is not changed
    jsonschema.validate(extra, schema)  # JSON Schema's default: open
    jsonschema.validate(plain, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(extra, closed)


def test_what_a_schema_says_about_additional_properties_is_kept():
    for stated in (True, False, {"type": "integer"}):
        schema = {"type": "object", "properties": {"a": {}}, "additionalProperties": stated}
        assert close_objects(schema) == schema
    schema = {"type": "object", "unevaluatedProperties": {"type": "integer"}}
    assert close_objects(schema) == schema
    assert close_objects({"type": "string", "maxLength": 3}) == {"type": "string",
                                                                 "maxLength": 3}
    assert close_objects(True) is True


def test_all_of_parts_stay_open_so_their_union_validates():
    schema = {"allOf": [PERSON, {"type": "object", "properties": {"age": {"type": "integer"},
                                                                   "pet": PERSON}}]}
    closed = close_objects(schema)
    jsonschema.validate({"name": "a", "age": 3, "pet": {"name": "b"}}, closed)
    with pytest.raises(jsonschema.ValidationError):  # what lies inside the parts is closed
        jsonschema.validate({"name": "a", "pet": {"name": "b", "x": 1}}, closed)
