"""Structured output through the official OpenAI SDK against live servers on the embedded SmolLM2: response_format
json_schema (the SDK's `parse` with a pydantic model, and 20 varied schemas checked by jsonschema, with DDTree on
and off, at T = 0 and T = 1) and json_object on both endpoints; bad schemas get a 400 envelope; the metrics count
constrained requests."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, Optional

import httpx
import jsonschema
import openai
import pydantic
import pytest

S, I, N, B = {"type": "string", "maxLength": 24}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(required: bool = True, **props) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required else [],
            "additionalProperties": False}


SCHEMAS = [  # (instruction, schema): nested objects, arrays, enums, bounded numbers, optional fields, $defs
    ("a person", obj(name=S, age={"type": "integer", "minimum": 0, "maximum": 120})),
    ("a city", obj(name=S, country=S, population={"type": "integer", "minimum": 0})),
    ("a color choice", obj(color={"enum": ["red", "green", "blue"]})),
    ("a rating", obj(stars={"type": "integer", "minimum": 1, "maximum": 5}, comment=S)),
    ("a temperature reading", obj(celsius={"type": "number", "minimum": -50, "maximum": 60})),
    ("three fruits", obj(fruits={"type": "array", "items": S, "minItems": 3, "maxItems": 3})),
    ("a yes/no answer", obj(answer=B)),
    ("a book", obj(title=S, author=obj(first=S, last=S), year={"type": "integer", "minimum": 1000,
                                                              "maximum": 2100})),
    ("a shopping list", obj(items={"type": "array", "items": obj(name=S, quantity={"type": "integer", "minimum": 1,
                                                                                   "maximum": 9}),
                                   "minItems": 1, "maxItems": 3})),
    ("a traffic light state", obj(state={"enum": ["stop", "wait", "go"]}, seconds={"type": "integer", "minimum": 0,
                                                                                   "maximum": 99})),
    ("a point", obj(x=N, y=N)),
    ("a user with an optional nickname", obj(False, name=S, nickname=S)),
    ("a status", {"type": "string", "enum": ["ok", "error", "pending"]}),
    ("a number between 1 and 10", {"type": "integer", "minimum": 1, "maximum": 10}),
    ("two tags", {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 2}),
    ("a movie", obj(title=S, genres={"type": "array", "items": {"enum": ["drama", "comedy", "action"]},
                                     "minItems": 1, "maxItems": 2}, rating={"type": "number", "minimum": 0,
                                                                             "maximum": 10})),
    ("a date", obj(day={"type": "integer", "minimum": 1, "maximum": 31},
                   month={"type": "integer", "minimum": 1, "maximum": 12})),
    ("an email", obj(address={"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"})),
    ("a tree node", {"$defs": {"leaf": obj(value={"type": "integer", "minimum": 0, "maximum": 9})},
                     **obj(left={"$ref": "#/$defs/leaf"}, right={"$ref": "#/$defs/leaf"})}),
    ("an id or a name", obj(key={"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, S]})),
]


def ask(client, model: str, what: str, schema: dict, temperature: float) -> tuple[str, str]:
    out = client.chat.completions.create(
        model=model, max_tokens=120, temperature=temperature, seed=7,
        messages=[{"role": "user", "content": f"Answer in JSON: {what}."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    return out.choices[0].message.content, out.choices[0].finish_reason


# n-gram DDTree on / speculation off (plain constrained decoding keeps its own default-run test beside the tree
# builder's, tests/speculative/test_grammar_tree.py: the twenty schemas there run under `make test-all`)
@pytest.mark.parametrize("which", ["server", pytest.param("plain_server", marks=pytest.mark.extended)])
def test_twenty_schemas_always_valid(request, which, model_name):
    live = request.getfixturevalue(which)
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.api_key or "unused", max_retries=0,
                       timeout=300) as client:
        jobs = [(what, schema, t) for t in (0.0, 1.0) for what, schema in SCHEMAS]
        with ThreadPoolExecutor(4) as pool:  # plain_server admits 4 at a time
            answers = list(pool.map(lambda job: ask(client, model_name, *job), jobs))
    for (what, schema, t), (text, finish) in zip(jobs, answers):
        assert finish == "stop", (what, t, text)
        jsonschema.validate(json.loads(text), schema)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["engineer", "artist", "doctor"]
    nickname: Optional[str] = pydantic.Field(None, max_length=12)


def test_sdk_parse_returns_the_pydantic_object(oai, model_name):
    out = oai.chat.completions.parse(model=model_name, temperature=0, max_tokens=100, response_format=Person,
                                     messages=[{"role": "user", "content": "Invent an engineer named Ada."}])
    person = out.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120, out.choices[0].message.content


def test_json_object_and_schema_on_both_endpoints(oai, model_name):
    chat = oai.chat.completions.create(model=model_name, max_tokens=120, temperature=0,
                                       response_format={"type": "json_object"},
                                       messages=[{"role": "user", "content": "Give a JSON object with two keys, "
                                                  "city and country, for Paris."}])
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "dog", "schema": obj(name=S, age=I)}}
    legacy = oai.completions.create(model=model_name, prompt="A JSON object describing a dog:", max_tokens=80,
                                    temperature=0, extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(legacy.choices[0].text), fmt["json_schema"]["schema"])


def test_streamed_json_equals_the_non_streamed(oai, model_name):
    kw = dict(model=model_name, max_tokens=80, temperature=0, messages=[{"role": "user", "content": "A city?"}],
              response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMAS[1][1]}})
    full = oai.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == full and json.loads(full)


@pytest.mark.parametrize("fmt,expect", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}, "Invalid type: nope"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}},
     "regex"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema' is required"),
    ({"type": "xml"}, "response_format.type"),
])
def test_bad_schemas_get_a_400_naming_the_problem(oai, model_name, fmt, expect):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                    response_format=fmt)
    assert expect in e.value.message and e.value.body["param"].startswith("response_format"), e.value.body


def test_metrics_count_constrained_requests(oai, model_name, server):
    def count() -> float:
        text = httpx.get(server.base_url + "/metrics", timeout=10).text
        line = next(x for x in text.splitlines() if x.startswith("ddtree:structured_output_requests_total"))
        return float(line.rsplit(" ", 1)[1])

    before = count()
    oai.chat.completions.create(model=model_name, max_tokens=40, temperature=0, response_format={"type": "json_object"},
                                messages=[{"role": "user", "content": "JSON please."}])
    assert count() == before + 1
