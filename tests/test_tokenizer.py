"""Demo tokenizer, chat template and incremental detokenizer (format: docs/format.md)."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import decoders

from model.serve.tokenizer import (
    CHAT_TEMPLATE,
    REASONING_BUDGET,
    REASONING_EFFORTS,
    SPECIAL_TOKENS,
    BeamTokenizer,
    build_demo_tokenizer,
    write_tokenizer_files,
)

VOCAB = 640
REPO = Path(__file__).resolve().parents[1]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "weather.lookup",
        "description": "Look up the weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
TOOL_TURN = {
    "role": "assistant",
    "reasoning_content": "Need the forecast.",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "weather.lookup", "arguments": {"days": 2, "city": "Paris"}},
        },
        {
            "id": "call_2",
            "type": "function",
            "function": {"name": "clock", "arguments": {"opts": {"tz": "CET"}, "utc": True}},
        },
    ],
}
CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    TOOL_TURN,
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    {"role": "assistant", "reasoning_content": "It is mild.", "content": "18 °C at noon."},
    {"role": "user", "content": "Thanks 😀"},
]
HEADER = "<|start|>system<|message|>Reasoning: max"
TOOLS_SECTION = "\n\n# Tools\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False)
EXPECTED_CONVERSATION = (
    HEADER + TOOLS_SECTION + "<|end|>"
    "<|start|>system<|message|>You are helpful.<|end|>"
    "<|start|>user<|message|>Weather in Paris?<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>Need the forecast.<|end|>"
    "<|start|>assistant to=weather.lookup<|channel|>analysis <|constrain|>xml<|message|>"
    '<rfl:parameter name="city">\nParis\n</rfl:parameter>'
    '<rfl:parameter name="days">\n2\n</rfl:parameter><|call|>'
    "<|start|>assistant to=clock<|channel|>analysis <|constrain|>xml<|message|>"
    '<rfl:parameter name="opts">\n{"tz": "CET"}\n</rfl:parameter>'
    '<rfl:parameter name="utc">\ntrue\n</rfl:parameter><|call|>'
    '<|start|>tool from=weather.lookup<|message|>{"temp": 18}<|end|>'
    "<|start|>tool from=clock<|message|>12:00<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>It is mild.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>18 °C at noon.<|end|>"
    "<|start|>user<|message|>Thanks 😀<|end|>"
    "<|start|>assistant"
)
UNICODE_TEXTS = [
    "",
    "hello world",
    "  leading and trailing spaces  \n\n",
    "naïve café — ½ ≠ ∞",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "中文字符和日本語のテキスト, 한국어",
    "combining e\u0301 and zero\u200bwidth",
    "control \x00\x01\x7f tab\t cr\r",
    "code: def f(x):\n    return {'a': [1, 2]}\n",
    "specials inline: <|start|>user<|message|>hi<|end|> and <|call|>",
]


@pytest.fixture(scope="module")
def tok() -> BeamTokenizer:
    return BeamTokenizer.demo(VOCAB)


def _random_unicode(rng: random.Random, n: int) -> str:
    pools = [(0x20, 0x7E), (0xA0, 0x2FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F), (0x0, 0x1F)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(pools)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def test_build_is_deterministic_across_processes() -> None:
    code = (
        "import hashlib; from model.serve.tokenizer import build_demo_tokenizer;"
        f"print(hashlib.sha256(build_demo_tokenizer({VOCAB}).to_str().encode()).hexdigest())"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    digests.add(hashlib.sha256(build_demo_tokenizer(VOCAB).to_str().encode()).hexdigest())
    assert len(digests) == 1


@pytest.mark.parametrize("vocab_size", [264, 300, 512, 777, 100_000])
def test_vocab_size_is_an_upper_bound(vocab_size: int) -> None:
    built = build_demo_tokenizer(vocab_size)
    assert 264 <= built.get_vocab_size() <= vocab_size


def test_vocab_size_too_small_raises() -> None:
    with pytest.raises(ValueError, match="at least 264"):
        build_demo_tokenizer(263)


def test_specials_have_lowest_ids_and_are_single_tokens(tok: BeamTokenizer) -> None:
    assert len(SPECIAL_TOKENS) == 8 and SPECIAL_TOKENS[-1] == "<|endoftext|>"
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_id(special) == i
        assert tok.encode(special) == [i]
        assert tok.encode(f"ab{special}cd").count(i) == 1
        assert tok.decode([i]) == special
        assert tok.decode([i], skip_special_tokens=True) == ""
    assert tok.stop_token_ids == (tok.token_id("<|return|>"), tok.token_id("<|call|>"))
    with pytest.raises(KeyError):
        tok.token_id("<|nope|>")


def test_all_bytes_are_in_the_alphabet(tok: BeamTokenizer) -> None:
    # Every single byte must encode without an unknown token, or some text could not round-trip.
    for b in range(256):
        text = bytes([b]).decode("latin-1")
        assert tok.decode(tok.encode(text)) == text


def test_format_words_are_single_tokens(tok: BeamTokenizer) -> None:
    for word in ("assistant", "analysis", "final"):
        assert len(tok.encode(word)) == 1, word


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_round_trip(tok: BeamTokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_random_unicode(tok: BeamTokenizer) -> None:
    rng = random.Random(0)
    for n in (1, 17, 123, 511):
        text = _random_unicode(rng, n)
        assert tok.decode(tok.encode(text)) == text


def _check_incremental(tok: BeamTokenizer, ids: list[int], skip_special: bool) -> None:
    decoder = tok.incremental_decoder(skip_special_tokens=skip_special)
    emitted = ""
    for k, token_id in enumerate(ids, start=1):
        emitted += decoder.feed(token_id)
        full = tok.decode(ids[:k], skip_special_tokens=skip_special)
        # Held-back bytes are exactly the trailing incomplete character of the full decode.
        assert "\ufffd" not in emitted
        assert full.startswith(emitted)
        assert full[len(emitted) :].strip("\ufffd") == ""
        if not full.endswith("\ufffd"):
            assert emitted == full
    emitted += decoder.finish()
    assert emitted == tok.decode(ids, skip_special_tokens=skip_special)


@pytest.mark.parametrize("skip_special", [False, True])
@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_incremental_decoder_matches_full_decode(
    tok: BeamTokenizer, text: str, skip_special: bool
) -> None:
    _check_incremental(tok, tok.encode(text), skip_special)


def test_incremental_decoder_flushes_incomplete_bytes(tok: BeamTokenizer) -> None:
    # A truncated emoji: all but its last token. finish() shows it the way a full decode does.
    ids = tok.encode("😀")[:-1]
    assert ids and tok.decode(ids).endswith("\ufffd")
    decoder = tok.incremental_decoder()
    assert "".join(decoder.feed(i) for i in ids) == ""
    assert decoder.finish() == tok.decode(ids)


def test_incremental_decoder_window_path_for_other_decoders() -> None:
    # Wrapping the decoder hides its type, so the generic window path is used with same output.
    built = build_demo_tokenizer(VOCAB)
    built.decoder = decoders.Sequence([decoders.ByteLevel()])
    wrapped = BeamTokenizer(built)
    assert not wrapped.incremental_decoder()._byte_level
    rng = random.Random(1)
    texts = [*UNICODE_TEXTS, _random_unicode(rng, 200)]
    for text in texts:
        for skip_special in (False, True):
            _check_incremental(wrapped, wrapped.encode(text), skip_special)


def test_written_files_load_in_from_pretrained(tmp_path: Path, tok: BeamTokenizer) -> None:
    write_tokenizer_files(tmp_path, VOCAB)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["bos_token"] == config["pad_token"] == "<|endoftext|>"
    assert config["eos_token"] == "<|return|>"
    assert config["model_max_length"] == 1_048_576
    assert (
        json.loads((tmp_path / "special_tokens_map.json").read_text())["eos_token"] == "<|return|>"
    )
    loaded = BeamTokenizer.from_pretrained(tmp_path)
    assert loaded.tokenizer.to_str() == tok.tokenizer.to_str()
    assert loaded.apply_chat_template(CONVERSATION) == tok.apply_chat_template(CONVERSATION)


def test_transformers_autotokenizer_agrees(tmp_path: Path, tok: BeamTokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    write_tokenizer_files(tmp_path, VOCAB)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in UNICODE_TEXTS:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
        assert hf.encode(text) == tok.encode(text, add_special_tokens=True)
        assert hf.decode(tok.encode(text)) == text
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (7, 5, 7)
    cases = [
        (CONVERSATION, [WEATHER_TOOL], "max"),
        (CONVERSATION[:2], None, "none"),
        (CONVERSATION[:4], [WEATHER_TOOL], "low"),
    ]
    for messages, tools, effort in cases:
        ours = tok.apply_chat_template(messages, tools=tools, reasoning_effort=effort)
        theirs = hf.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=True,
            tokenize=False,
            reasoning_effort=effort,
        )
        assert theirs == ours
    # transformers' default effort (none passed) is the template's default, max.
    default = hf.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True, tokenize=False)
    assert default == tok.apply_chat_template(CONVERSATION[:2])


def test_template_renders_format(tok: BeamTokenizer) -> None:
    assert tok.apply_chat_template(CONVERSATION, tools=[WEATHER_TOOL]) == EXPECTED_CONVERSATION


def test_template_effort_none_prefills_empty_reasoning(tok: BeamTokenizer) -> None:
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], reasoning_effort="none")
    assert rendered == (
        "<|start|>system<|message|>Reasoning: none<|end|><|start|>user<|message|>hi<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|><|end|><|start|>assistant"
    )


@pytest.mark.parametrize("effort", REASONING_EFFORTS)
def test_template_effort_in_header(tok: BeamTokenizer, effort: str) -> None:
    rendered = tok.apply_chat_template([{"role": "user", "content": "x"}], reasoning_effort=effort)
    assert rendered.startswith(f"<|start|>system<|message|>Reasoning: {effort}<|end|>")
    assert rendered.endswith("<|start|>assistant")


def test_template_without_generation_prompt_and_developer(tok: BeamTokenizer) -> None:
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},  # no reasoning: rendered empty
    ]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert rendered == (
        HEADER + "<|end|><|start|>developer<|message|>Be brief.<|end|>"
        "<|start|>user<|message|>hi<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|><|end|>"
        "<|start|>assistant<|channel|>final<|message|>hello<|end|>"
    )


def test_template_tool_names_by_name_id_and_position(tok: BeamTokenizer) -> None:
    by_position = [
        *CONVERSATION[:3],
        {"role": "tool", "content": "a"},
        {"role": "tool", "content": "b"},
    ]
    by_name = [*CONVERSATION[:3], {"role": "tool", "name": "other", "content": "a"}]
    reordered = [
        *CONVERSATION[:3],
        {"role": "tool", "tool_call_id": "call_2", "content": "b"},
        {"role": "tool", "tool_call_id": "call_1", "content": "a"},
    ]
    assert (
        "<|start|>tool from=weather.lookup<|message|>a<|end|><|start|>tool from=clock<|message|>b"
        in (tok.apply_chat_template(by_position))
    )
    assert "<|start|>tool from=other<|message|>a<|end|>" in tok.apply_chat_template(by_name)
    assert "<|start|>tool from=clock<|message|>b<|end|><|start|>tool from=weather.lookup" in (
        tok.apply_chat_template(reordered)
    )


def test_template_accepts_openai_string_arguments_and_reasoning_aliases(
    tok: BeamTokenizer,
) -> None:
    turn = json.loads(json.dumps(TOOL_TURN))
    for call in turn["tool_calls"]:
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    turn["thinking"] = turn.pop("reasoning_content")
    messages = [*CONVERSATION[:2], turn, *CONVERSATION[3:]]
    assert tok.apply_chat_template(messages, tools=[WEATHER_TOOL]) == EXPECTED_CONVERSATION


def test_template_errors_name_the_problem(tok: BeamTokenizer) -> None:
    with pytest.raises(ValueError, match="reasoning_effort must be one of"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], reasoning_effort="huge")
    with pytest.raises(ValueError, match="unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="names no tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    bad = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}
    with pytest.raises(ValueError, match="not JSON"):
        tok.apply_chat_template([bad])


def test_reasoning_budget() -> None:
    assert tuple(REASONING_BUDGET) == REASONING_EFFORTS
    assert REASONING_BUDGET["none"] == 0 and REASONING_BUDGET["max"] == 512
    budgets = [REASONING_BUDGET[e] for e in REASONING_EFFORTS]
    assert budgets == sorted(budgets) and len(set(budgets)) == len(budgets)
