"""Unit tests for flask_solidloop.mcp.toolset: declaration, schemas and calling."""

import asyncio
import contextvars
import datetime
import functools
import gc
import json
import logging
import re
import threading
import time
from typing import Annotated, Any, Literal, Optional

import mcp.types
import pytest
from pydantic import BaseModel, Field

from flask_solidloop.errors import LostLeaseError, SolidLoopError, ToolDefinitionError
from flask_solidloop.mcp import CallContext, ToolDefinition, ToolResult, Toolset, bridge


class Address(BaseModel):
    street: str
    zip_code: str


class Hit(BaseModel):
    title: str
    score: float
    when: datetime.date | None = None


def schema_of(ts: Toolset, name: str) -> dict:
    return ts.get(name).input_schema


def props(ts: Toolset, name: str) -> dict:
    return schema_of(ts, name)["properties"]


def strip_titles(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: strip_titles(v) for k, v in node.items() if k != "title"}
    if isinstance(node, list):
        return [strip_titles(v) for v in node]
    return node


# --------------------------------------------------------------------------- schemas


def test_schema_from_scalar_hints() -> None:
    ts = Toolset("demo")

    @ts.tool
    def f(s: str, i: int, x: float, flag: bool) -> None:
        pass

    schema = schema_of(ts, "f")
    assert schema["type"] == "object"
    assert schema["required"] == ["s", "i", "x", "flag"]
    assert strip_titles(schema["properties"]) == {
        "s": {"type": "string"},
        "i": {"type": "integer"},
        "x": {"type": "number"},
        "flag": {"type": "boolean"},
    }
    assert "title" not in schema


def test_schema_list_optional_literal_and_defaults() -> None:
    ts = Toolset("demo")

    @ts.tool
    def f(
        tags: list[str],
        mode: Literal["fast", "slow"] = "fast",
        limit: int = 10,
        maybe: Optional[int] = None,  # noqa: UP045 - Optional is what we test
        union: str | None = None,
    ) -> None:
        pass

    schema = schema_of(ts, "f")
    p = strip_titles(schema["properties"])
    assert schema["required"] == ["tags"]
    assert p["tags"] == {"type": "array", "items": {"type": "string"}}
    assert p["mode"]["enum"] == ["fast", "slow"]
    assert p["mode"]["default"] == "fast"
    assert p["limit"] == {"type": "integer", "default": 10}
    assert p["maybe"]["anyOf"] == [{"type": "integer"}, {"type": "null"}]
    assert p["maybe"]["default"] is None
    assert p["union"]["anyOf"] == [{"type": "string"}, {"type": "null"}]


def test_required_omitted_when_every_parameter_has_a_default() -> None:
    ts = Toolset("demo")

    @ts.tool
    def f(a: int = 1) -> None:
        pass

    @ts.tool
    def g() -> None:
        pass

    assert "required" not in schema_of(ts, "f")
    assert schema_of(ts, "g") == {"type": "object", "properties": {}}


def test_schema_with_pydantic_model_parameter() -> None:
    ts = Toolset("demo")
    received = {}

    @ts.tool
    def ship(address: Address, note: str = "") -> str:
        received["address"] = address
        return "ok"

    schema = schema_of(ts, "ship")
    assert schema["required"] == ["address"]
    ref = schema["properties"]["address"]["$ref"]
    assert ref == "#/$defs/Address"
    assert set(schema["$defs"]["Address"]["properties"]) == {"street", "zip_code"}

    result = ts.call("ship", {"address": {"street": "Main St", "zip_code": "12345"}})
    assert not result.is_error
    assert received["address"] == Address(street="Main St", zip_code="12345")


def test_unannotated_parameter_is_any() -> None:
    ts = Toolset("demo")

    @ts.tool
    def f(anything, n: int = 0):  # type: ignore[no-untyped-def]
        return {"got": anything}

    assert props(ts, "f")["anything"] == {}
    assert ts.call("f", {"anything": [1, "two"]}).structured_content == {"got": [1, "two"]}


def test_annotated_field_metadata_is_kept() -> None:
    ts = Toolset("demo")

    @ts.tool
    def f(n: Annotated[int, Field(ge=1, description="how many")]) -> int:
        """Count.

        Args:
            n: from the docstring
        """
        return n

    p = props(ts, "f")["n"]
    assert p["minimum"] == 1
    assert p["description"] == "how many"  # explicit Field metadata wins
    assert ts.call("f", {"n": 0}).is_error


def test_awkward_parameter_names() -> None:
    ts = Toolset("demo")

    @ts.tool
    def f(json: str, schema: int = 1, _private: bool = False) -> dict:
        return {"json": json, "schema": schema, "_private": _private}

    assert set(props(ts, "f")) == {"json", "schema", "_private"}
    result = ts.call("f", {"json": "x", "schema": 2, "_private": True})
    assert result.structured_content == {"json": "x", "schema": 2, "_private": True}


def test_string_annotations_and_locally_defined_types() -> None:
    class Local(BaseModel):
        v: int

    ts = Toolset("demo")

    @ts.tool
    def f(item: "Local", n: "int", ctx: "CallContext") -> int:
        return item.v + n

    assert ts.get("f").context_param == "ctx"
    assert set(props(ts, "f")) == {"item", "n"}
    assert ts.call("f", {"item": {"v": 2}, "n": 3}).text() == "5"


def test_unresolvable_annotation_raises() -> None:
    ts = Toolset("demo")
    with pytest.raises(ToolDefinitionError, match="NoSuchType"):

        @ts.tool
        def f(x: "NoSuchType") -> None:  # type: ignore[name-defined]  # noqa: F821
            pass


def test_non_schema_type_raises_definition_error() -> None:
    ts = Toolset("demo")

    class Opaque:
        pass

    with pytest.raises(ToolDefinitionError, match="'f'"):

        @ts.tool
        def f(x: Opaque) -> None:
            pass


# --------------------------------------------------------------------------- descriptions


def test_docstring_first_paragraph_and_args() -> None:
    ts = Toolset("demo")

    @ts.tool
    def search(query: str, limit: int = 5) -> str:
        """Search the catalogue
        for matching products.

        Longer explanation that is not part of the description.

        Args:
            query: The text to look for.
                Continued on a second line.
            limit (int): Maximum number of hits.

        Returns:
            The hits.
        """
        return ""

    definition = ts.get("search")
    assert definition.description == "Search the catalogue for matching products."
    p = definition.input_schema["properties"]
    assert p["query"]["description"] == "The text to look for. Continued on a second line."
    assert p["limit"]["description"] == "Maximum number of hits."


def test_explicit_description_wins_and_missing_docstring_is_empty() -> None:
    ts = Toolset("demo")

    @ts.tool(description="Explicit.")
    def a() -> None:
        """Docstring."""

    @ts.tool
    def b() -> None:
        pass

    assert ts.get("a").description == "Explicit."
    assert ts.get("b").description == ""


def test_args_section_without_blank_line_does_not_leak_into_description() -> None:
    ts = Toolset("demo")

    @ts.tool
    def f(x: int) -> None:
        """Do it.
        Args:
            x: the x
        """

    assert ts.get("f").description == "Do it."
    assert props(ts, "f")["x"]["description"] == "the x"


# --------------------------------------------------------------------------- context


def test_ctx_injected_by_annotation() -> None:
    ts = Toolset("demo")
    seen = {}

    @ts.tool
    def f(a: int, context: CallContext) -> str:
        seen["ctx"] = context
        return "ok"

    assert ts.get("f").context_param == "context"
    assert "context" not in props(ts, "f")
    ctx = CallContext(agent="A", loop="L", idempotency_key="solidloop:tool_call:7")
    ts.call("f", {"a": 1}, ctx)
    assert seen["ctx"] is ctx


def test_ctx_injected_by_optional_annotation_and_by_name() -> None:
    ts = Toolset("demo")
    seen = []

    @ts.tool
    def f(a: int, c: CallContext | None = None) -> None:
        seen.append(c)

    @ts.tool
    def g(ctx, a: int) -> None:  # type: ignore[no-untyped-def]
        seen.append(ctx)

    assert ts.get("f").context_param == "c"
    assert ts.get("g").context_param == "ctx"
    assert set(props(ts, "g")) == {"a"}
    ctx = CallContext(principal="user-1")
    ts.call("f", {"a": 1}, ctx)
    ts.call("g", {"a": 1})
    assert seen[0] is ctx
    assert isinstance(seen[1], CallContext)  # a default context when none is given
    assert seen[1].agent is None


def test_ctx_named_but_annotated_is_a_normal_argument() -> None:
    ts = Toolset("demo")

    @ts.tool
    def f(ctx: str) -> str:
        return ctx

    assert ts.get("f").context_param is None
    assert ts.call("f", {"ctx": "hello"}).text() == "hello"


def test_two_context_parameters_raise() -> None:
    ts = Toolset("demo")
    with pytest.raises(ToolDefinitionError, match="context"):

        @ts.tool
        def f(a: CallContext, b: CallContext) -> None:
            pass


def test_ctx_argument_from_caller_cannot_override_context() -> None:
    ts = Toolset("demo")
    seen = []

    @ts.tool
    def f(ctx: CallContext) -> None:
        seen.append(ctx)

    ts.call("f", {"ctx": "spoofed"})
    assert isinstance(seen[0], CallContext)


# --------------------------------------------------------------------------- explicit schema


def test_explicit_input_schema_is_verbatim_and_only_checks_required() -> None:
    ts = Toolset("demo")
    schema = {
        "type": "object",
        "properties": {"q": {"type": "string", "title": "Query"}, "n": {"type": "integer"}},
        "required": ["q"],
        "additionalProperties": False,
    }
    calls = []

    @ts.tool(input_schema=schema)
    def raw(ctx: CallContext, **kwargs: Any) -> None:
        calls.append((ctx, kwargs))

    assert ts.get("raw").input_schema is schema
    assert ts.list_tools()[0]["inputSchema"] == schema
    # No pydantic validation: a wrong type goes through untouched.
    assert not ts.call("raw", {"q": 123, "n": "not-an-int"}).is_error
    assert calls[0][1] == {"q": 123, "n": "not-an-int"}
    assert isinstance(calls[0][0], CallContext)

    missing = ts.call("raw", {"n": 1})
    assert missing.is_error
    assert missing.text() == "invalid arguments for tool 'raw': q: Field required"


def test_explicit_input_schema_must_be_an_object_schema() -> None:
    ts = Toolset("demo")
    with pytest.raises(ToolDefinitionError, match="input_schema"):

        @ts.tool(input_schema={"type": "string"})
        def f(**kwargs: Any) -> None:
            pass


# --------------------------------------------------------------------------- names & decorator


@pytest.mark.parametrize("bad", ["", "has space", "slash/name", "ü", "x" * 129, "<lambda>"])
def test_invalid_tool_names_raise(bad: str) -> None:
    ts = Toolset("search")
    with pytest.raises(ToolDefinitionError) as info:
        ts.tool(lambda: None, name=bad)
    message = str(info.value)
    assert "'search'" in message
    assert repr(bad) in message
    assert "^[A-Za-z0-9._-]{1,128}$" in message
    assert len(ts) == 0


def test_lambda_without_name_is_rejected() -> None:
    ts = Toolset("search")
    with pytest.raises(ToolDefinitionError, match="<lambda>"):
        ts.tool(lambda: None)


def test_valid_unusual_names_are_accepted() -> None:
    ts = Toolset("search")
    for name in ["a", "a.b", "a-b_c", "X" * 128, "0"]:
        ts.tool(lambda: None, name=name)
    assert len(ts) == 5


def test_duplicate_name_raises() -> None:
    ts = Toolset("search")

    @ts.tool
    def find() -> None:
        pass

    with pytest.raises(ToolDefinitionError) as info:

        @ts.tool(name="find")
        def other() -> None:
            pass

    message = str(info.value)
    assert "'search'" in message and "'find'" in message and "unique" in message
    assert issubclass(ToolDefinitionError, SolidLoopError)


# --------------------------------------------------------------------------- add_tool


def test_add_tool_returns_the_stored_definition_and_leaves_fn_alone() -> None:
    ts = Toolset("orders")

    def find_order(number: str, ctx: CallContext) -> str:
        """Look up an order.

        Args:
            number: The order number.
        """
        return f"order {number} for {ctx.idempotency_key}"

    definition = ts.add_tool(find_order)
    assert isinstance(definition, ToolDefinition)
    assert ts.get("find_order") is definition and list(ts) == [definition]
    assert definition.handler is find_order and definition.context_param == "ctx"
    assert definition.description == "Look up an order."
    assert definition.to_mcp() == ts.list_tools()[0]
    assert props(ts, "find_order") == {"number": {"description": "The order number.",
                                                  "type": "string"}}
    ctx = CallContext(idempotency_key="solidloop:tool_call:3")
    assert ts.call("find_order", {"number": "A-1"}, ctx).text() == (
        "order A-1 for solidloop:tool_call:3")
    assert find_order("B-2", ctx) == "order B-2 for solidloop:tool_call:3"  # unchanged

    schema = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    raw = ts.add_tool(lambda **kw: kw["q"], name="raw", description="Raw.",
                      input_schema=schema)
    assert (raw.name, raw.description, raw.input_schema) == ("raw", "Raw.", schema)
    assert ts.call("raw", {"q": "x"}).text() == "x"
    with pytest.raises(TypeError):
        ts.add_tool(find_order, "positional_name")  # type: ignore[misc]  # options are keywords


def test_the_decorator_goes_through_add_tool() -> None:
    """add_tool is the single path into a toolset: every decorator form calls it."""

    class Recording(Toolset):
        def __init__(self, name: str) -> None:
            super().__init__(name)
            self.added: list[tuple[str, dict[str, Any]]] = []

        def add_tool(self, fn: Any, **options: Any) -> ToolDefinition:
            self.added.append((fn.__name__, options))
            return super().add_tool(fn, **options)

    ts = Recording("demo")

    @ts.tool
    def bare() -> None:
        pass

    @ts.tool()
    def called() -> None:
        pass

    @ts.tool(name="renamed", description="Renamed.")
    def options() -> None:
        pass

    def direct() -> None:
        pass

    assert ts.tool(direct) is direct
    waits = {"requires_approval": False, "deferred": False, "approval_timeout": None,
             "on_timeout": "deny", "result_timeout": None, "timeout": None,
             "rate_limit": None, "task": None}
    none = {"name": None, "description": None, "input_schema": None, **waits}
    assert ts.added == [
        ("bare", none),
        ("called", none),
        ("options", {**none, "name": "renamed", "description": "Renamed."}),
        ("direct", none),
    ]
    assert [d.name for d in ts] == ["bare", "called", "renamed", "direct"]


def test_add_tool_resolves_string_annotations_of_local_types() -> None:
    class Local(BaseModel):
        v: int

    def f(item: "Local", ctx: "CallContext") -> int:
        return item.v

    ts = Toolset("demo")
    assert ts.add_tool(f).context_param == "ctx"
    assert ts.call("f", {"item": {"v": 4}}).text() == "4"


def misuse(call: Any) -> str:
    """Run a declaration that must fail; return its message."""
    with pytest.raises(ToolDefinitionError) as info:
        call()
    return str(info.value)


def test_misuse_says_what_was_wrong_and_what_to_do() -> None:
    ts = Toolset("search")

    def lookup(q: str) -> str:
        return q

    # The name where the function goes.
    message = misuse(lambda: ts.tool("lookup"))
    assert "'search'" in message and "@tool(name='lookup')" in message
    message = misuse(lambda: ts.add_tool("lookup"))  # type: ignore[arg-type]
    assert "add_tool(fn, name='lookup')" in message

    # The result of calling the function instead of the function.
    message = misuse(lambda: ts.add_tool(lookup("x")))  # type: ignore[arg-type]
    assert "got str 'x'" in message and "not add_tool(fn())" in message
    message = misuse(lambda: ts.add_tool(42))  # type: ignore[arg-type]
    assert "got int 42" in message and "add_tool(fn), not add_tool(fn())" in message

    # The decorator used on the class instead of a toolset.
    message = misuse(lambda: Toolset.tool(lookup))  # type: ignore[call-overload]
    assert "on the class" in message and "Toolset('search')" in message

    # Options of the wrong type.
    assert "name= must be a string" in misuse(lambda: ts.add_tool(lookup, name=7))  # type: ignore[arg-type]
    assert "description= must be a string" in misuse(
        lambda: ts.add_tool(lookup, description=["Find."]))  # type: ignore[arg-type]

    # A lambda has no name of its own.
    message = misuse(lambda: ts.add_tool(lambda: None))
    assert "'<lambda>'" in message and "pass name='...'" in message
    # Nor does a partial.
    assert "pass name='...'" in misuse(lambda: ts.add_tool(functools.partial(lookup)))
    assert len(ts) == 0  # nothing was added by any of these


def test_misuse_with_async_functions_and_class_bodies(recwarn: pytest.WarningsRecorder) -> None:
    ts = Toolset("search")

    async def fetch(url: str) -> str:
        return url

    message = misuse(lambda: ts.add_tool(fetch("https://example.com")))  # type: ignore[arg-type]
    assert "coroutine" in message and "did you call it?" in message
    gc.collect()
    assert not [w for w in recwarn if "never awaited" in str(w.message)]

    with pytest.raises(ToolDefinitionError, match=r"classmethod object.*add_tool\(MyClass"):

        class Service:
            @ts.tool  # type: ignore[arg-type]
            @classmethod
            def ping(cls) -> str:
                return "pong"

    definition = ts.add_tool(fetch)
    message = misuse(lambda: Toolset("other").add_tool(definition))  # type: ignore[arg-type]
    assert "ToolDefinition" in message and "definition.handler" in message


def test_duplicate_name_names_the_tool_that_has_it_and_keeps_it() -> None:
    ts = Toolset("search")

    def find() -> str:
        return "first"

    first = ts.add_tool(find)
    message = misuse(lambda: ts.add_tool(lambda: "second", name="find"))
    assert "'find' is already declared" in message and "unique" in message
    assert "test_toolset" in message and "find" in message  # who holds the name
    assert "pass name=" in message
    assert ts.get("find") is first and ts.call("find", {}).text() == "first"


def test_a_failed_add_tool_adds_nothing() -> None:
    ts = Toolset("demo")

    def f(x: int) -> int:
        return x

    misuse(lambda: ts.add_tool(f, input_schema={"type": "array"}))
    assert len(ts) == 0 and "f" not in ts
    assert ts.add_tool(f).name == "f"  # the name is still free


def test_invalid_toolset_name_raises() -> None:
    with pytest.raises(ToolDefinitionError, match="toolset name"):
        Toolset("bad name")


def test_bare_and_parametrised_decorator_return_the_function() -> None:
    ts = Toolset("demo", description="Demo tools")

    def plain(a: int) -> int:
        return a * 2

    assert ts.tool(plain) is plain

    def other(a: int) -> int:
        return a + 1

    assert ts.tool(name="renamed", description="Renamed.")(other) is other

    assert plain(2) == 4  # still a normal function
    assert [d.name for d in ts] == ["plain", "renamed"]
    assert "renamed" in ts and "other" not in ts and 42 not in ts
    assert len(ts) == 2
    assert ts.description == "Demo tools"
    assert ts.call("renamed", {"a": 1}).text() == "2"


def test_list_tools_in_declaration_order_and_definition_to_mcp() -> None:
    ts = Toolset("demo")

    @ts.tool
    def zeta() -> None:
        """Last letter."""

    @ts.tool
    def alpha(x: int) -> None:
        """First letter."""

    tools = ts.list_tools()
    assert [t["name"] for t in tools] == ["zeta", "alpha"]
    assert tools[0] == {
        "name": "zeta",
        "description": "Last letter.",
        "inputSchema": {"type": "object", "properties": {}},
    }
    definition = ts.get("alpha")
    assert isinstance(definition, ToolDefinition)
    assert definition.to_mcp() == tools[1]
    # The advertised dicts are valid MCP Tool objects.
    for tool in tools:
        mcp.types.Tool.model_validate(tool)


def test_get_unknown_raises_key_error() -> None:
    ts = Toolset("demo")
    with pytest.raises(KeyError, match="unknown tool"):
        ts.get("nope")


@pytest.mark.parametrize(
    "signature",
    ["def f(*args: int) -> None: pass", "def f(**kwargs: int) -> None: pass"],
)
def test_var_args_raise(signature: str) -> None:
    namespace: dict[str, Any] = {}
    exec(signature, namespace)
    ts = Toolset("demo")
    with pytest.raises(ToolDefinitionError, match=r"\*"):
        ts.tool(namespace["f"])


def test_positional_only_raises() -> None:
    ts = Toolset("demo")
    with pytest.raises(ToolDefinitionError, match="positional-only"):

        @ts.tool
        def f(a: int, /) -> None:
            pass


def test_bound_method_and_callable_instance() -> None:
    class Service:
        def __init__(self) -> None:
            self.base = 10

        def bump(self, n: int) -> int:
            """Bump."""
            return self.base + n

        def __call__(self, word: str) -> str:
            return word.upper()

    svc = Service()
    ts = Toolset("demo")
    ts.tool(svc.bump)
    ts.tool(svc, name="shout")
    assert set(props(ts, "bump")) == {"n"}
    assert ts.call("bump", {"n": 1}).text() == "11"
    assert ts.call("shout", {"word": "hi"}).text() == "HI"


# --------------------------------------------------------------------------- results


def make_returning(value: Any) -> Toolset:
    ts = Toolset("demo")
    ts.tool(lambda: value, name="r")
    return ts


def test_str_result() -> None:
    result = make_returning("héllo").call("r", {})
    assert result == ToolResult(content=[{"type": "text", "text": "héllo"}])


def test_dict_result_is_structured_and_json_text() -> None:
    result = make_returning({"city": "Zürich", "n": 2}).call("r", {})
    assert result.structured_content == {"city": "Zürich", "n": 2}
    assert result.text() == '{"city": "Zürich", "n": 2}'  # ensure_ascii=False
    assert not result.is_error


def test_dict_result_with_non_json_values_is_made_json() -> None:
    result = make_returning({"day": datetime.date(2024, 5, 1)}).call("r", {})
    assert result.structured_content == {"day": "2024-05-01"}
    assert json.loads(result.text()) == {"day": "2024-05-01"}


def test_model_result_dumped_in_json_mode() -> None:
    hit = Hit(title="Tée", score=0.5, when=datetime.date(2024, 1, 2))
    result = make_returning(hit).call("r", {})
    assert result.structured_content == {"title": "Tée", "score": 0.5, "when": "2024-01-02"}
    assert json.loads(result.text()) == result.structured_content
    assert "Tée" in result.text()


def test_tool_result_passes_through() -> None:
    original = ToolResult(content=[{"type": "image", "data": "AAA", "mimeType": "image/png"}])
    assert make_returning(original).call("r", {}) is original


def test_none_result_is_empty_text() -> None:
    result = make_returning(None).call("r", {})
    assert result.content == [{"type": "text", "text": ""}]
    assert result.structured_content is None


@pytest.mark.parametrize(
    ("value", "text"),
    [([1, "a", None], '[1, "a", null]'), (3, "3"), (2.5, "2.5"), (True, "true"), (["ö"], '["ö"]')],
)
def test_json_serialisable_results(value: Any, text: str) -> None:
    result = make_returning(value).call("r", {})
    assert result.text() == text
    assert result.structured_content is None


def test_unserialisable_result_uses_str() -> None:
    class Thing:
        def __str__(self) -> str:
            return "a thing"

    assert make_returning(Thing()).call("r", {}).text() == "a thing"
    assert make_returning({1, 2}).call("r", {}).text() in ("{1, 2}", "{2, 1}")


# --------------------------------------------------------------------------- errors


def test_handler_exception_becomes_error_result_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ts = Toolset("demo")

    @ts.tool
    def boom(x: int) -> None:
        raise ValueError(f"bad x {x}")

    with caplog.at_level(logging.WARNING, logger="flask_solidloop.tools"):
        result = ts.call("boom", {"x": 3})
    assert result.is_error
    assert result.text() == "ValueError: bad x 3"
    assert "Traceback" not in result.text()
    records = [r for r in caplog.records if r.name == "flask_solidloop.tools"]
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING
    assert records[0].exc_info is not None


def test_exception_without_message_and_custom_class() -> None:
    class QuotaExceeded(Exception):
        pass

    ts = Toolset("demo")

    @ts.tool
    def a() -> None:
        raise QuotaExceeded("no more")

    @ts.tool
    def b() -> None:
        raise KeyError

    assert ts.call("a", {}).text() == "QuotaExceeded: no more"
    assert ts.call("b", {}).text() == "KeyError"


def test_lost_lease_propagates() -> None:
    ts = Toolset("demo")

    @ts.tool
    def f() -> None:
        raise LostLeaseError("gone")

    with pytest.raises(LostLeaseError):
        ts.call("f", {})


def test_validation_errors_name_each_field() -> None:
    ts = Toolset("demo")

    @ts.tool
    def add(a: int, b: int) -> int:
        return a + b

    result = ts.call("add", {"a": "x"})
    assert result.is_error
    text = result.text()
    assert text.startswith("invalid arguments for tool 'add': ")
    assert "a: Input should be a valid integer" in text
    assert "(got 'x')" in text
    assert "b: Field required" in text
    assert text.index("a: ") < text.index("b: ")


def test_validation_errors_for_literal_and_nested_fields() -> None:
    ts = Toolset("demo")

    @ts.tool
    def f(mode: Literal["fast", "slow"], address: Address) -> None:
        pass

    text = ts.call("f", {"mode": "medium", "address": {"street": "x"}}).text()
    assert "mode: Input should be 'fast' or 'slow' (got 'medium')" in text
    assert "address.zip_code: Field required" in text


def test_lax_coercion_and_extra_arguments_ignored() -> None:
    ts = Toolset("demo")

    @ts.tool
    def add(a: int, b: int = 1) -> int:
        return a + b

    assert ts.call("add", {"a": "4", "unexpected": True}).text() == "5"


def test_handler_defaults_apply_when_argument_omitted() -> None:
    ts = Toolset("demo")
    sentinel: list[int] = []

    @ts.tool
    def f(items: list[int] | None = None) -> bool:
        return items is None

    @ts.tool
    def g(items: list[int] = sentinel) -> bool:
        return items is sentinel

    assert ts.call("f", {}).text() == "true"
    assert ts.call("g", {}).text() == "true"
    assert ts.call("f", None).text() == "true"


@pytest.mark.parametrize(("arguments", "kind"), [([1, 2], "array"), ("x", "string"), (3, "number")])
def test_non_object_arguments(arguments: Any, kind: str) -> None:
    ts = Toolset("demo")

    @ts.tool
    def f(a: int = 0) -> None:
        pass

    result = ts.call("f", arguments)
    assert result.is_error
    assert "must be a JSON object" in result.text()
    assert kind in result.text()


def test_unknown_tool_lists_available() -> None:
    ts = Toolset("search")

    @ts.tool
    def a() -> None:
        pass

    @ts.tool
    def b() -> None:
        pass

    result = ts.call("x", {})
    assert result.is_error
    assert result.text() == "unknown tool 'x' in toolset 'search'; available tools: a, b"
    empty = Toolset("empty").call("x", {})
    assert empty.text() == "unknown tool 'x' in toolset 'empty'; available tools: none"


# --------------------------------------------------------------------------- async


def test_async_handler() -> None:
    ts = Toolset("demo")

    @ts.tool
    async def slow_add(a: int, b: int, ctx: CallContext) -> dict:
        await asyncio.sleep(0)
        return {"sum": a + b, "key": ctx.idempotency_key}

    ctx = CallContext(idempotency_key="solidloop:tool_call:1")
    result = ts.call("slow_add", {"a": 1, "b": 2}, ctx)
    assert result.structured_content == {"sum": 3, "key": "solidloop:tool_call:1"}


def test_async_handler_exception_is_error_result() -> None:
    ts = Toolset("demo")

    @ts.tool
    async def fail() -> None:
        raise RuntimeError("async boom")

    result = ts.call("fail", {})
    assert result.is_error and result.text() == "RuntimeError: async boom"


def test_async_handler_called_from_running_loop() -> None:
    ts = Toolset("demo")

    @ts.tool
    async def ping() -> str:
        await asyncio.sleep(0)
        return "pong"

    async def caller() -> ToolResult:
        return ts.call("ping", {})

    assert asyncio.run(caller()).text() == "pong"


def test_async_handler_runs_on_a_loop_of_its_own_not_the_mcp_portal() -> None:
    """Thread, context variables and loop of an async tool (mcp/bridge.py, run_isolated)."""
    ts = Toolset("demo")
    request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id")
    seen: dict[str, Any] = {}

    @ts.tool
    async def probe() -> str:
        seen["thread"] = threading.get_ident()
        seen["loop"] = asyncio.get_running_loop()
        seen["request_id"] = request_id.get("unset")

        async def via_the_portal() -> str:
            return "transport answer"

        # An async tool may call a synchronous MCP transport (which waits on the
        # portal); on the portal's own thread this would raise "would deadlock".
        return bridge.run_sync(via_the_portal, timeout=5)

    token = request_id.set("req-7")
    try:
        assert ts.call("probe", {}).text() == "transport answer"
    finally:
        request_id.reset(token)
    assert seen["thread"] == threading.get_ident()  # no thread hop, thread-locals work
    assert seen["request_id"] == "req-7"
    assert seen["loop"] is not bridge.get_portal().loop and seen["loop"].is_closed()


def test_a_blocking_async_handler_does_not_stall_the_mcp_portal() -> None:
    ts = Toolset("demo")
    release = threading.Event()

    @ts.tool
    async def blocks() -> str:
        release.wait(5)  # blocking call inside async def: a common mistake in tools
        return "done"

    async def noop() -> None:
        return None

    results: list[ToolResult] = []
    worker = threading.Thread(target=lambda: results.append(ts.call("blocks", {})))
    worker.start()
    try:
        started = time.monotonic()
        bridge.run_sync(noop, timeout=2)  # the portal still answers at once
        assert time.monotonic() - started < 1.0
    finally:
        release.set()
        worker.join(5)
    assert [r.text() for r in results] == ["done"]


# --------------------------------------------------------------------------- ToolResult


def test_tool_result_text_joins_text_blocks() -> None:
    result = ToolResult(
        content=[
            {"type": "text", "text": "one"},
            {"type": "image", "data": "AAA", "mimeType": "image/png"},
            {"type": "text", "text": "two"},
        ]
    )
    assert result.text() == "one\ntwo"


def test_tool_result_error() -> None:
    result = ToolResult.error("nope")
    assert result.is_error
    assert result.content == [{"type": "text", "text": "nope"}]
    assert result.to_mcp() == {"content": [{"type": "text", "text": "nope"}], "isError": True}


def test_to_mcp_from_mcp_round_trip() -> None:
    plain = ToolResult(content=[{"type": "text", "text": "hi"}])
    assert plain.to_mcp() == {"content": [{"type": "text", "text": "hi"}], "isError": False}
    assert "structuredContent" not in plain.to_mcp()
    assert ToolResult.from_mcp(plain.to_mcp()) == plain

    structured = make_returning({"a": [1, 2]}).call("r", {})
    data = structured.to_mcp()
    assert data["structuredContent"] == {"a": [1, 2]}
    assert ToolResult.from_mcp(data) == structured
    assert ToolResult.from_mcp(json.loads(json.dumps(data))) == structured

    # The JSON is a valid MCP CallToolResult, and MCP's own JSON reads back.
    parsed = mcp.types.CallToolResult.model_validate(data)
    assert parsed.structured_content == {"a": [1, 2]}
    dumped = parsed.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert ToolResult.from_mcp(dumped).text() == structured.text()

    error = ToolResult.error("bad")
    assert ToolResult.from_mcp(error.to_mcp()) == error


def test_from_mcp_defaults_and_rejects_non_objects() -> None:
    assert ToolResult.from_mcp({}) == ToolResult(content=[])
    with pytest.raises(ValueError):
        ToolResult.from_mcp([])  # type: ignore[arg-type]


def test_waiting_rules_are_checked_when_the_tool_is_declared() -> None:
    ts = Toolset("money")

    @ts.tool(requires_approval=True, approval_timeout=60, on_timeout="approve")
    def refund(amount: float) -> str:
        return "refunded"

    @ts.tool(requires_approval=lambda arguments, ctx: arguments["amount"] > 50)
    def credit(amount: float) -> str:
        return "credited"

    @ts.tool(deferred=True, result_timeout=3600)
    def ask_a_human(question: str) -> str:
        """The loop never runs this: a person answers it."""
        raise AssertionError("not run by a loop")

    assert ts.get("refund").wait.requires_approval is True
    assert ts.get("refund").wait.approval_timeout == 60.0
    assert callable(ts.get("credit").wait.requires_approval)
    assert ts.get("ask_a_human").wait.deferred and ts.get("ask_a_human").wait.waits
    assert not ts.get("credit").wait.deferred
    for options, message in (
            ({"requires_approval": "yes"}, "requires_approval= must be True, False or a callable"),
            ({"deferred": True, "requires_approval": True}, "cannot also require an approval"),
            ({"requires_approval": True, "on_timeout": "shrug"}, "on_timeout= must be one of"),
            ({"requires_approval": True, "approval_timeout": 0}, "number of seconds > 0"),
            ({"approval_timeout": 5}, "approval_timeout= needs requires_approval="),
            ({"on_timeout": "approve"}, "on_timeout= needs requires_approval="),
            ({"result_timeout": 5}, "result_timeout= needs deferred=True")):
        with pytest.raises(ToolDefinitionError, match=re.escape(message)):
            ts.add_tool(lambda x: x, name="bad", **options)
    assert "bad" not in ts  # a refused declaration adds nothing
