"""The Claude agent's tools: their schemas, and how the harness answers each.

Readers answer from the task (contract, reference, current best, profile, numerics notes) or the
registry (`read_variant`); `check_candidate` and `profile_candidate` go to the harness's
evaluation workers (a quick one-shape check, Nsight Compute metrics of the last verified
submission); `submit_variant` ends the turn as a proposal, answered on the next one with the
harness's verdict. A tool that is misused gets an error result that says what to send instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .base import OptimizationTask, Proposal, numerics_notes

LANGUAGES = ("triton", "cute")
MAX_TOOL_TEXT = 60_000


def _schema(props: dict | None = None, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": props or {}, "required": list(required)}


_SOURCE = {"type": "string", "description": "the whole Python module"}
_LANGUAGE = {"type": "string", "enum": list(LANGUAGES),
             "description": "the kernel language; the module must declare the same "
                            "`LANGUAGE = \"...\"` (absent: triton)"}
_CONFIG = {"type": "object", "description": "optional config passed to run(..., config=)"}

TOOLS: list[dict] = [
    {"name": "read_contract", "description": "The op's signature, docstring, numerics policy, "
     "shapes and hardware.", "input_schema": _schema()},
    {"name": "read_reference", "description": "Source of the op's reference module (plain "
     "PyTorch; the single source of truth).", "input_schema": _schema()},
    {"name": "read_current_best", "description": "Source and evidence record of the variant "
     "currently selected for this op (the one to beat).", "input_schema": _schema()},
    {"name": "read_variant", "description": "Source and record of any registered variant (of "
     "this op by default) as a starting point; an unknown name lists the known ones.",
     "input_schema": _schema({"variant": {"type": "string"},
                              "op": {"type": "string", "description": "default: this op"}},
                             ("variant",))},
    {"name": "read_profile", "description": "The op's row of the target's profile (time, calls,"
     " kernels, bytes, floor, gap) and earlier attempts.", "input_schema": _schema()},
    {"name": "read_numerics_notes", "description": "Where the reference rounds, reduction "
     "orders, Triton facts that matter.", "input_schema": _schema()},
    {"name": "check_candidate", "description": "Compile and run a module at ONE small shape "
     "against the reference: the compiler's error, or how many elements differ and the first "
     "mismatches. Not a submission (nothing recorded); passing it is no verdict.",
     "input_schema": _schema({"source": _SOURCE, "language": _LANGUAGE, "config": _CONFIG,
                              "tokens": {"type": "integer", "description": "token count of "
                                         "the shape (default: the smallest served)"}},
                             ("source",))},
    {"name": "profile_candidate", "description": "Nsight Compute metrics of your last VERIFIED "
     "submission's kernels at the target's shapes: duration, DRAM bytes and throughput as a "
     "share of the measured ceiling, achieved occupancy, registers and shared memory per block,"
     " L2 hit rate, top warp-stall reasons. A plain message where there is no GPU or no ncu.",
     "input_schema": _schema()},
    {"name": "submit_variant", "description": "Submit a complete variant module. The harness "
     "verifies it and, on a GPU, times it; the result is its verdict with the reasons, or the "
     "time per shape against the baseline, the reference and the floor.",
     "input_schema": _schema({
         "source": _SOURCE, "language": _LANGUAGE,
         "name": {"type": "string", "description": "short name hint, e.g. rows4"},
         "notes": {"type": "string", "description": "hypothesis -> prediction"},
         "config": _CONFIG,
     }, ("source",))},
    {"name": "finish", "description": "End the session.",
     "input_schema": _schema({"summary": {"type": "string"}})},
]

READERS: dict[str, Callable[[OptimizationTask], str]] = {
    "read_contract": lambda t: t.contract_text(),
    "read_reference": lambda t: t.reference_source,
    "read_current_best": lambda t: (f"current selection: {t.current_name}\n\n{t.current_source}"
                                    f"\n\nrecord:\n{json.dumps(t.current_record, indent=1)}"),
    "read_profile": lambda t: f"{t.profile_text()}\n\nearlier attempts:\n{t.history_text()}",
    "read_numerics_notes": lambda t: numerics_notes(),
}


def language_of(args: dict) -> tuple[str | None, str | None]:
    """(language, None) or (None, error text) from a tool call's `language`."""
    lang = str(args.get("language") or "triton")
    if lang not in LANGUAGES:
        return None, f"language must be one of {', '.join(LANGUAGES)}, not {lang!r}"
    return lang, None


def proposal_from(args: dict, meta: dict) -> tuple[Proposal | None, str | None]:
    """The proposal a submit/check call describes, or the error to send back."""
    if not args.get("source"):
        return None, "this tool needs a non-empty `source` (the whole module)"
    lang, err = language_of(args)
    if err:
        return None, err
    config = args.get("config") if isinstance(args.get("config"), dict) else None
    return Proposal(source=str(args["source"]), name_hint=str(args.get("name") or "v"),
                    notes=str(args.get("notes") or ""), config=config, language=lang,
                    meta=meta), None


def check_shape(task: OptimizationTask, args: dict) -> dict | None:
    """The bench shape at the asked token count (or the smallest); None: use the harness's."""
    if not task.shapes:
        return None
    shapes = sorted(task.shapes, key=lambda s: int(s["T"]))
    want = args.get("tokens")
    if isinstance(want, int) and want > 0:
        return {**shapes[0], "T": want}
    return dict(shapes[0])


def clip(text: str) -> str:
    if len(text) > MAX_TOOL_TEXT:
        return text[:MAX_TOOL_TEXT] + f"\n[truncated at {MAX_TOOL_TEXT} characters]"
    return text


def answer(name: str, args: dict, task: OptimizationTask, evaluator: Any,
           last_pass: Proposal | None, meta: dict) -> tuple[str, bool]:
    """(text, is_error) for every tool but submit_variant and finish."""
    if name in READERS:
        return READERS[name](task), False
    if name == "read_variant":
        if not args.get("variant"):
            return "read_variant needs `variant` (a registered variant's name)", True
        return evaluator.read_variant(str(args.get("op") or task.op), str(args["variant"]))
    if name == "check_candidate":
        proposal, err = proposal_from(args, meta)
        if err:
            return err, True
        return evaluator.check(proposal, check_shape(task, args)), False
    if name == "profile_candidate":
        if last_pass is None:
            return ("no verified submission yet: profile_candidate profiles your last "
                    "submission that passed verification"), True
        return evaluator.profile(last_pass), False
    return f"unknown tool {name!r}; the tools are {', '.join(t['name'] for t in TOOLS)}", True


__all__ = ["LANGUAGES", "READERS", "TOOLS", "answer", "clip", "proposal_from"]
