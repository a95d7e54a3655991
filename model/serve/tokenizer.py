"""Beam tokenizer: the built-in demo BPE, encoding/decoding and incremental detokenization.

A real checkpoint ships its own `tokenizer.json` and chat template; `BeamTokenizer.from_pretrained`
reads those, and the demo tokenizer written by `write_tokenizer_files` loads the same way in
`transformers.AutoTokenizer`. The chat format (`docs/format.md`) lives in
`model.serve.chat_template`; its public names are re-exported here for existing callers.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from model.serve.chat_template import (
    CHAT_TEMPLATE,
    DEFAULT_REASONING_EFFORT,
    REASONING_BUDGET,
    REASONING_EFFORTS,
    ChatTemplate,
    read_chat_template,
)

__all__ = [
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "DEFAULT_REASONING_EFFORT",
    "EOS_TOKEN",
    "MODEL_MAX_LENGTH",
    "PAD_TOKEN",
    "REASONING_BUDGET",
    "REASONING_EFFORTS",
    "SPECIAL_TOKENS",
    "STOP_TOKENS",
    "TOKENIZER_CLASS",
    "BeamTokenizer",
    "ChatTemplate",
    "IncrementalDecoder",
    "build_demo_tokenizer",
    "read_chat_template",
    "write_tokenizer_files",
]

# Order is the id order: these get ids 0..7 and ids must never move between builds.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
    "<|endoftext|>",
)
BOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|return|>"
STOP_TOKENS: tuple[str, ...] = ("<|return|>", "<|call|>")
MODEL_MAX_LENGTH = 1_048_576

# "PreTrainedTokenizerFast" loads as transformers 5's TokenizersBackend and also in transformers
# 4.x and vLLM, which do not know the name "TokenizersBackend".
TOKENIZER_CLASS = "PreTrainedTokenizerFast"

# Training text for the demo BPE: English, code, JSON and the words of the chat format, so common
# format words become single tokens. Changing it changes every id above 7: treat it as frozen.
_DEMO_CORPUS = (
    """\
You are Beam, a helpful assistant. Reasoning: max. Reasoning: low. Reasoning: medium.
The assistant thinks in the analysis channel and answers in the final channel.
analysis final analysis final assistant assistant user user system developer tool
The user asks about the weather in Paris, London, Tokyo and New York today and tomorrow.
The weather is sunny with a light wind; the temperature is 18 degrees and it may rain later.
Let me look up the weather first, then answer the question with the forecast for the week.
I should call the weather.lookup tool with the city and the number of days.
<rfl:parameter name="city">
Paris
</rfl:parameter><rfl:parameter name="days">
3
</rfl:parameter><rfl:parameter name="units">
celsius
</rfl:parameter>
<rfl:parameter name="query">
weather forecast
</rfl:parameter><rfl:parameter name="path">
src/main.py
</rfl:parameter>
# Tools
{"type": "function", "function": {"name": "weather.lookup", "description": "Look up the weather",
 "parameters": {"type": "object", "properties": {"city": {"type": "string"},
 "days": {"type": "integer"}, "verbose": {"type": "boolean"}}, "required": ["city"]}}}
{"temperature": 18, "condition": "sunny", "humidity": 0.45, "wind": null, "alerts": []}
{"id": "call_0", "name": "search", "arguments": {"query": "python list sort", "limit": 10}}
def fibonacci(n: int) -> int:
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Scheduler:
    def __init__(self, max_batch: int = 32) -> None:
        self.queue: list[str] = []
        self.max_batch = max_batch

    def step(self) -> list[str]:
        batch, self.queue = self.queue[: self.max_batch], self.queue[self.max_batch :]
        return batch


if __name__ == "__main__":
    print(fibonacci(10))
    for i in range(3):
        print(f"step {i}: {Scheduler().step()}")
import json, os, sys
from pathlib import Path
x = [1, 2, 3]; y = {"a": 1, "b": [true, false, null]}; z = x[0] + y["a"]
const result = await fetch(url).then((response) => response.json());
SELECT name, count(*) FROM users WHERE active = 1 GROUP BY name ORDER BY name;
The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024.
What is 17 * 19? Let me compute: 17 * 19 = 323. The answer is 323.
Thank you! You're welcome. Could you explain how the model serves requests in a batch?
The server streams tokens as they are generated, and the parser splits reasoning from content.
A mixture of experts routes each token to a few experts, so only part of the model is active.
Attention reads the key and value cache; a sliding window keeps only the most recent tokens.
Hello, world! Hello there. How are you? I am fine, thanks. Good morning, good evening.
"""
    + (
        # In a prompt these words follow a special token directly, with no space before them.
        "assistant\nanalysis\nfinal\nuser\nsystem\ndeveloper\ntool\nReasoning\nxml\nrfl\n" * 4
    )
)


def build_demo_tokenizer(vocab_size: int) -> Tokenizer:
    """Train the demo byte-level BPE on the built-in corpus, at most `vocab_size` tokens.

    Specials take ids 0..7 (SPECIAL_TOKENS order), the 256 byte symbols follow, then merges.
    """
    minimum = len(SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the demo tokenizer needs {minimum} ids for "
            f"{len(SPECIAL_TOKENS)} special tokens and 256 bytes; pass at least {minimum}"
        )
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: a leading space would be invented on encode and break the round trip.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_DEMO_CORPUS.splitlines(keepends=True), trainer)
    # The corpus yields fewer merges than the model's vocabulary; every id the model can emit
    # must decode to something, so the rest are reserved tokens (as released vocabularies have).
    reserved = vocab_size - tokenizer.get_vocab_size()
    tokenizer.add_tokens([AddedToken(f"<|reserved_{i}|>", special=False, normalized=False)
                          for i in range(reserved)])
    return tokenizer


def write_tokenizer_files(
    path: str | Path, vocab_size: int, model_max_length: int = MODEL_MAX_LENGTH
) -> None:
    """Write the demo tokenizer as an HF tokenizer directory (AutoTokenizer loads it)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    build_demo_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
    special_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    config = {
        "tokenizer_class": TOKENIZER_CLASS,
        **special_map,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


class BeamTokenizer:
    """Encode, decode and render chats with a `tokenizers.Tokenizer` and a Jinja chat template."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str = CHAT_TEMPLATE) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._template = ChatTemplate(chat_template)
        self._special_ids = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        )

    @classmethod
    def demo(cls, vocab_size: int) -> BeamTokenizer:
        return cls(build_demo_tokenizer(vocab_size))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> BeamTokenizer:
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.exists():
            raise FileNotFoundError(
                f"no tokenizer.json in {path}; expected an HF tokenizer directory "
                "(write one with write_tokenizer_files)"
            )
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        return cls(Tokenizer.from_file(str(tokenizer_file)), read_chat_template(path, config))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(self.token_id(t) for t in STOP_TOKENS)

    def token_id(self, tok: str) -> int:
        token_id = self.tokenizer.token_to_id(tok)
        if token_id is None:
            raise KeyError(f"token {tok!r} is not in the vocabulary of {self.vocab_size} tokens")
        return token_id

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it become their single ids."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        reasoning_effort: str | None = DEFAULT_REASONING_EFFORT,
    ) -> str:
        """Render `messages` to the prompt string (not tokenized)."""
        return self._template.render(messages, tools, add_generation_prompt, reasoning_effort)

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-char table, inverted (the one the ByteLevel decoder uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_DECODER = _byte_decoder()


class IncrementalDecoder:
    """Turn token ids, fed one at a time, into text deltas whose concatenation is `decode(ids)`.

    Bytes of a UTF-8 character split across tokens are held back until the character completes,
    so no delta carries a replacement character that a later token would have fixed.
    """

    def __init__(self, tokenizer: BeamTokenizer, skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._byte_level = isinstance(tokenizer.tokenizer.decoder, decoders.ByteLevel)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Decoders that are not byte-level: decode a window that starts one emitted token back,
        # so context-dependent decoders (a leading-space strip) see what came before.
        self._ids: list[int] = []
        self._read = 0

    def feed(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        if self._skip_special and self._tok.is_special(token_id):
            return ""
        if self._byte_level:
            return self._feed_bytes(token_id)
        return self._feed_window(token_id)

    def finish(self) -> str:
        """Flush what is held back; incomplete bytes become U+FFFD, as in a full decode."""
        if self._byte_level:
            return self._utf8.decode(b"", final=True)
        return self._window_delta(final=True)

    def _feed_bytes(self, token_id: int) -> str:
        token = self._tok.tokenizer.id_to_token(token_id)
        if token is None:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary of {self._tok.vocab_size} tokens"
            )
        try:
            raw = bytes(_BYTE_DECODER[c] for c in token)
        except KeyError:
            raw = token.encode("utf-8")  # added tokens are stored as plain text, as in tokenizers
        return self._utf8.decode(raw)

    def _feed_window(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._window_delta(final=False)

    def _window_delta(self, final: bool) -> str:
        seen = self._tok.decode(self._ids[: self._read])
        text = self._tok.decode(self._ids)
        if not final and (len(text) <= len(seen) or text.endswith("\ufffd")):
            return ""  # an unfinished character: wait for the token that completes it
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return text[len(seen) :]
