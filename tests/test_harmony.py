"""Parsing Beam's responses (format: docs/format.md); streaming must equal non-streaming."""

from __future__ import annotations

import json
import random

import pytest

from model.serve.harmony import (
    Delta,
    ParsedResponse,
    StreamingParser,
    ToolCall,
    parse_response,
    render_tool_call,
)
from model.serve.tokenizer import SPECIAL_TOKENS, BeamTokenizer

REASON = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"
FINAL = "<|start|>assistant<|channel|>final<|message|>"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather.lookup",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "verbose": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "tags": {"type": "array"},
                    "ratio": {"type": "number"},
                    "none": {"type": "null"},
                    "maybe": {"type": ["integer", "null"]},
                    "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                },
            },
        },
    },
    {"name": "clock", "parameters": {"properties": {"utc": {"type": "boolean"}}}},  # flat form
]


def call(name: str, params: dict[str, str], closer: str = "<|call|>") -> str:
    """A tool-call message body as generated (after `<|start|>assistant`), raw string values."""
    body = "".join(
        f'<rfl:parameter name="{k}">\n{v}\n</rfl:parameter>' for k, v in sorted(params.items())
    )
    return f" to={name}<|channel|>analysis <|constrain|>xml<|message|>{body}{closer}"


CALL_HEAD = " to=weather.lookup<|channel|>analysis <|constrain|>xml<|message|>"
PARIS = '<rfl:parameter name="city">\nParis\n</rfl:parameter>'
TOOL_TEXT = REASON + "Check the weather." + NEXT + call("weather.lookup", {"city": "Paris"})
PARALLEL_TEXT = (
    REASON
    + "Two calls."
    + NEXT
    + call("weather.lookup", {"city": "Paris", "days": "3"}, closer="<|end|>")
    + "<|start|>assistant"
    + call("clock", {"utc": "true"})
)
ANSWER_TEXT = (
    REASON + "Think <b> a < c |> d." + NEXT + "<|channel|>final<|message|>It is 18 °C 😀.<|return|>"
)
CORPUS = [
    ANSWER_TEXT,
    TOOL_TEXT,
    PARALLEL_TEXT,
    REASON + "r" + NEXT + "<|channel|>final<|message|>answer<|end|>",
    REASON + "r" + NEXT + "<|channel|>final<|message|>answer<|call|>",
    REASON + "" + NEXT + "<|channel|>final<|message|><|return|>",
    REASON
    + "r"
    + NEXT
    + "<|channel|>final<|message|>pre"
    + "<|end|><|start|>assistant"
    + call("clock", {"utc": "false"}),
    call("weather.lookup", {"opts": '{"a": [1, 2]}', "verbose": "maybe"}),
    "<|channel|>final<|message|>no reasoning, literal <|start|> inside<|return|>",
    '<|start|>assistant<|channel|>final<|message|>x <rfl:parameter name="a">\ny\n</rfl:parameter>',
    "Plain text that ignores the format <|end|>",
    REASON + "half a marker <|en",
    call("weather.lookup", {"city": "Par"})[:-20],
]


def accumulate(deltas: list[Delta]) -> ParsedResponse:
    """What a streaming client builds from the deltas alone."""
    reasoning, content = [], []
    names: dict[int, str] = {}
    args: dict[int, dict] = {}
    for d in deltas:
        if d.kind == "reasoning":
            reasoning.append(d.text)
        elif d.kind == "content":
            content.append(d.text)
        elif d.kind == "tool_call_start":
            assert d.index == len(names) and d.name
            names[d.index] = d.name
        else:
            assert d.kind == "tool_call_args" and d.index in names and d.index not in args
            args[d.index] = json.loads(d.arguments)
    assert sorted(args) == sorted(names), "every started call must get its arguments"
    calls = [ToolCall(names[i], args[i]) for i in sorted(names)]
    return ParsedResponse("".join(reasoning), "".join(content), calls)


def stream(chunks: list[str], tools: list[dict] | None = None) -> ParsedResponse:
    parser = StreamingParser(tools)
    deltas = [d for chunk in chunks for d in parser.feed(chunk)] + parser.finish()
    result = accumulate(deltas)
    assert result == parser.result()
    return result


def test_reasoning_then_answer() -> None:
    assert parse_response(ANSWER_TEXT) == ParsedResponse(
        "Think <b> a < c |> d.", "It is 18 °C 😀.", []
    )


@pytest.mark.parametrize("closer", ["<|return|>", "<|end|>", "<|call|>"])
def test_answer_closes_at_each_closer(closer: str) -> None:
    text = REASON + "r" + NEXT + "<|channel|>final<|message|>answer" + closer + "ignored"
    assert parse_response(text) == ParsedResponse("r", "answer", [])


def test_single_tool_call_with_dotted_name() -> None:
    expected = ParsedResponse(
        "Check the weather.", "", [ToolCall("weather.lookup", {"city": "Paris"})]
    )
    assert parse_response(TOOL_TEXT, TOOLS) == expected


def test_parallel_tool_calls() -> None:
    parsed = parse_response(PARALLEL_TEXT, TOOLS)
    assert parsed.reasoning == "Two calls." and parsed.content == ""
    assert parsed.tool_calls == [
        ToolCall("weather.lookup", {"city": "Paris", "days": 3}),
        ToolCall("clock", {"utc": True}),
    ]


def test_parallel_calls_after_call_token() -> None:
    text = call("a.b", {"x": "1"}) + "<|start|>assistant" + call("c", {})
    assert parse_response(text).tool_calls == [ToolCall("a.b", {"x": "1"}), ToolCall("c", {})]


def test_typed_arguments_follow_the_schema() -> None:
    params = {
        "city": "42",
        "days": "3",
        "verbose": "false",
        "opts": '{"units": "C", "n": [1, 2]}',
        "tags": '["a", "b"]',
        "ratio": "0.5",
        "none": "null",
        "maybe": "7",
        "either": "7",
    }
    parsed = parse_response(call("weather.lookup", params), TOOLS)
    assert parsed.tool_calls[0].arguments == {
        "city": "42",  # a string parameter stays text even when it looks like JSON
        "days": 3,
        "verbose": False,
        "opts": {"units": "C", "n": [1, 2]},
        "tags": ["a", "b"],
        "ratio": 0.5,
        "none": None,
        "maybe": 7,
        "either": "7",  # string is one of its types, so it stays text
    }


def test_typed_argument_that_does_not_parse_stays_text() -> None:
    text = call("weather.lookup", {"days": "three", "verbose": "yes", "extra": "5"})
    args = parse_response(text, TOOLS).tool_calls[0].arguments
    assert args == {"days": "three", "verbose": "yes", "extra": "5"}


def test_without_tools_values_are_text() -> None:
    args = parse_response(call("weather.lookup", {"days": "3"})).tool_calls[0].arguments
    assert args == {"days": "3"}


def test_exactly_one_newline_is_stripped_each_side() -> None:
    text = call("f", {"v": "\n  two lines\nhere  \n"})
    assert parse_response(text).tool_calls[0].arguments == {"v": "\n  two lines\nhere  \n"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (REASON + "still thinking", ParsedResponse("still thinking", "", [])),
        (REASON + "done" + NEXT, ParsedResponse("done", "", [])),
        (REASON + "done<|end|><|start|>assis", ParsedResponse("done", "", [])),
        (
            REASON + "r" + NEXT + "<|channel|>final<|message|>half an ans",
            ParsedResponse("r", "half an ans", []),
        ),
        (
            REASON + "r" + NEXT + " to=weather.look",
            ParsedResponse("r", "", [ToolCall("weather.look", {})]),
        ),
        (
            REASON + "r" + NEXT + " to=clock<|channel|>analy",
            ParsedResponse("r", "", [ToolCall("clock", {})]),
        ),
        (
            CALL_HEAD + PARIS + '<rfl:parameter name="days">\n2',
            ParsedResponse("", "", [ToolCall("weather.lookup", {"city": "Paris", "days": 2})]),
        ),
        (
            CALL_HEAD + PARIS + '<rfl:parameter name="da',
            ParsedResponse("", "", [ToolCall("weather.lookup", {"city": "Paris"})]),
        ),
        (
            CALL_HEAD + '<rfl:parameter name="city">\nParis\n</rfl:par',
            ParsedResponse("", "", [ToolCall("weather.lookup", {"city": "Paris"})]),
        ),
        (
            CALL_HEAD + '<rfl:parameter name="city">\nPar',
            ParsedResponse("", "", [ToolCall("weather.lookup", {"city": "Par"})]),
        ),
        ("", ParsedResponse("", "", [])),
        ("<|chan", ParsedResponse("", "", [])),
    ],
)
def test_truncated_text_yields_what_is_there(text: str, expected: ParsedResponse) -> None:
    assert parse_response(text, TOOLS) == expected


def test_text_outside_the_format_is_content() -> None:
    assert parse_response("Hello world") == ParsedResponse("", "Hello world", [])
    assert parse_response("today<|return|>") == ParsedResponse("", "today", [])


def test_leading_generation_prompt_is_accepted() -> None:
    assert parse_response("<|start|>assistant" + TOOL_TEXT, TOOLS) == parse_response(
        TOOL_TEXT, TOOLS
    )


def test_content_then_tool_call_in_one_turn() -> None:
    parsed = parse_response(CORPUS[6], TOOLS)
    assert parsed == ParsedResponse("r", "pre", [ToolCall("clock", {"utc": False})])


@pytest.mark.parametrize("text", CORPUS)
def test_every_two_chunk_split_equals_whole_parse(text: str) -> None:
    whole = parse_response(text, TOOLS)
    for cut in range(len(text) + 1):
        assert stream([text[:cut], text[cut:]], TOOLS) == whole, cut


@pytest.mark.parametrize("text", CORPUS)
def test_every_truncation_streams_like_whole_parse(text: str) -> None:
    for end in range(len(text) + 1):
        prefix = text[:end]
        assert stream(list(prefix), TOOLS) == parse_response(prefix, TOOLS), end


@pytest.mark.parametrize("seed", range(20))
def test_random_multi_chunk_splits(seed: int) -> None:
    rng = random.Random(seed)
    for text in CORPUS:
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 12))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert "".join(chunks) == text
        assert stream(chunks, TOOLS) == parse_response(text, TOOLS)


@pytest.fixture(scope="module")
def tok() -> BeamTokenizer:
    return BeamTokenizer.demo(640)


@pytest.mark.parametrize("text", CORPUS)
def test_token_by_token_stream_equals_whole_parse(tok: BeamTokenizer, text: str) -> None:
    # The server's path: ids -> incremental detokenizer -> parser, one token at a time.
    ids = tok.encode(text)
    decoder = tok.incremental_decoder()
    chunks = [decoder.feed(i) for i in ids] + [decoder.finish()]
    assert "".join(chunks) == text
    assert stream(chunks, TOOLS) == parse_response(text, TOOLS)


def test_no_partial_marker_is_emitted_when_streaming_characters() -> None:
    parser = StreamingParser(TOOLS)
    deltas = [d for ch in PARALLEL_TEXT for d in parser.feed(ch)] + parser.finish()
    texts = [d.text for d in deltas if d.kind in ("reasoning", "content")]
    assert texts and not any("<" in t or "|" in t for t in texts)
    kinds = [d.kind for d in deltas if d.kind.startswith("tool")]
    assert kinds == ["tool_call_start", "tool_call_args"] * 2


def test_tool_call_starts_as_soon_as_its_name_is_whole() -> None:
    parser = StreamingParser()
    assert parser.feed(" to=weather.look") == []
    assert parser.feed("up<") == [Delta("tool_call_start", name="weather.lookup", index=0)]


def test_stream_holds_back_only_possible_markers() -> None:
    parser = StreamingParser()
    parser.feed(REASON)
    assert parser.feed("a <b") == [Delta("reasoning", text="a <b")]
    assert parser.feed(" <|en") == [Delta("reasoning", text=" ")]
    assert parser.feed("x") == [Delta("reasoning", text="<|enx")]
    # A whole special token that closes nothing here is text, and is not held back.
    assert parser.feed("<|start|>") == [Delta("reasoning", text="<|start|>")]
    assert parser.finish() == []
    with pytest.raises(RuntimeError):
        parser.feed("more")


def test_render_tool_call_matches_template(tok: BeamTokenizer) -> None:
    args = {"utc": True, "city": "Paris", "opts": {"a": [1, "é"]}}
    turn = {
        "role": "assistant",
        "reasoning_content": "r",
        "tool_calls": [{"function": {"name": "weather.lookup", "arguments": args}}],
    }
    rendered = tok.apply_chat_template([turn], add_generation_prompt=False)
    assert rendered.endswith(render_tool_call("weather.lookup", args))


def test_generated_turn_round_trips_through_the_template(tok: BeamTokenizer) -> None:
    # Multi-turn prefix caching relies on history rendering exactly what the model generated.
    history = [{"role": "user", "content": "Weather?"}]
    prompt = tok.apply_chat_template(history, tools=TOOLS)
    generated = REASON + "Check." + NEXT + call("weather.lookup", {"city": "Paris", "days": "2"})
    parsed = parse_response(generated, TOOLS)
    turn = {
        "role": "assistant",
        "reasoning_content": parsed.reasoning,
        "tool_calls": [
            {"function": {"name": c.name, "arguments": c.arguments}} for c in parsed.tool_calls
        ],
    }
    rerendered = tok.apply_chat_template([*history, turn], tools=TOOLS, add_generation_prompt=False)
    assert rerendered == prompt + generated


def test_special_tokens_list_covers_closers() -> None:
    assert {"<|return|>", "<|end|>", "<|call|>", "<|start|>"} <= set(SPECIAL_TOKENS)


@pytest.mark.parametrize("schema,written,parsed", [
    (True, "3", "3"),  # boolean schemas (valid JSON Schema) name no type: kept as written
    ({"anyOf": [True, {"type": "integer"}]}, "3", 3),
    ({"type": ["integer", "null"]}, "null", None),
    ({"type": "number"}, "NaN", "NaN"),  # not JSON: would make the response invalid JSON
    ({"type": "number"}, "Infinity", "Infinity"),
    ({"type": 5}, "3", "3"),
    ({"type": [{"a": 1}, "integer"]}, "3", 3),
])
def test_arguments_under_unusual_but_valid_schemas(schema, written, parsed) -> None:
    from model.serve.harmony import parse_arguments

    body = f'<rfl:parameter name="x">\n{written}\n</rfl:parameter>'
    assert parse_arguments(body, {"x": schema}) == {"x": parsed}
