"""Small command implementations that need no module of their own."""

from __future__ import annotations

import time

import torch
from rich.console import Console
from rich.table import Table

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}") from None


def run_forward(args, console: Console) -> None:
    from model import load_model
    from model.serve.tokenizer import BeamTokenizer

    tok = BeamTokenizer.from_pretrained(args.model)
    m = load_model(args.model, dtype=parse_dtype(args.dtype), device=args.device)
    ids = tok.encode(args.prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    start = time.perf_counter()
    logits = m(torch.tensor([ids], device=args.device))
    elapsed = time.perf_counter() - start
    probs = torch.softmax(logits[0, -1], dim=-1)
    values, indices = probs.topk(min(args.top, probs.numel()))
    table = Table(
        title=f"next token after {len(ids)} prompt tokens "
        f"({m.config.num_hidden_layers} layers, {args.dtype}, {args.device})"
    )
    table.add_column("token id", justify="right")
    table.add_column("text")
    table.add_column("p", justify="right")
    for p, i in zip(values.tolist(), indices.tolist()):
        table.add_row(str(i), repr(tok.decode([i])), f"{p:.4f}")
    console.print(table)
    console.print(f"logits {tuple(logits.shape)} {logits.dtype}, forward {elapsed * 1e3:.1f} ms")
