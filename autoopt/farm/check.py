"""`check_candidate`: one small shape against the reference, with the first mismatching elements.

A quick look for the agent before it submits, not a verdict: the source is screened as for a
submission, loaded in the judge's sandboxed worker (so an import or compile error comes back as
it is raised), called once on inputs of one shape, and its outputs are compared with the
reference's element by element. Nothing is recorded or registered, and passing it says nothing
about the full verification (other shapes, seeds, edge cases, the behavioural checks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

MAX_SHOWN = 8


def check_one(op: str, path: Path, device: str, shape: dict, config: dict | None,
              timeout_s: float) -> dict:
    from autoopt.eval.channel import Worker, WorkerError
    from autoopt.eval.numerics import effective_policy, judge
    from autoopt.eval.plan import Secret
    from autoopt.eval.run import POISON_DTYPES, palette_bits, start_candidate
    from autoopt.eval.screen import static_screen
    from autoopt.eval.trials import Judge
    from autoopt.eval.verify import CPU_MEM_LIMIT
    from model.ops import contract
    from model.ops.precision import contract_precision

    c = contract(op)
    text = path.read_bytes()
    screen = static_screen(text.decode("utf-8", "replace"), path.name)
    if screen:
        return {"stage": "screen", "errors": screen, "shape": shape}
    s = Secret()
    cuda = device.startswith("cuda")
    with contract_precision(), Worker(device, budget_s=timeout_s,
                                      mem_limit_bytes=None if cuda else CPU_MEM_LIMIT) as w:
        try:
            palettes = {dt: s.palette(dt) for dt in POISON_DTYPES}
            err = start_candidate(w, text, device, config, palettes, s.seed())
            if err:
                return {"stage": "import", "errors": [err], "shape": shape}
            j = Judge(c, w, device, palette_bits(palettes))
            case = j.make_case(shape, s.seed())
            if case is None:
                return {"stage": "inputs", "errors": j.skipped, "shape": shape}
            j.first_call(case)
        except WorkerError as e:
            return {"stage": "run", "errors": [str(e)], "shape": shape,
                    "stderr_tail": w.stderr_tail()[-1500:]}
    findings = j.findings.reasons()
    out: dict[str, Any] = {"stage": "run", "shape": shape, "findings": findings,
                           "outputs": []}
    if case.first is None:
        out["errors"] = findings or ["the call returned no outputs"]
        return out
    policy_fail: list[str] = []
    for (key, i), stats in j.stats.items():
        policy = effective_policy(c.numerics, j.dtypes[i], device)
        policy_fail += judge(policy, stats, f"output {i} at {key}")
    for i, (o, r) in enumerate(zip(case.first, case.ref, strict=True)):
        out["outputs"].append(mismatches(i, o, r))
    out["policy"] = policy_fail
    out["passed"] = not findings and not policy_fail
    return out


def mismatches(i: int, got: torch.Tensor, want: torch.Tensor) -> dict:
    """How many elements differ (bitwise) and the first MAX_SHOWN of them."""
    g, w = got.detach().cpu(), want.detach().cpu()
    if g.dtype.is_floating_point:
        differ = ~((g == w) | (torch.isnan(g) & torch.isnan(w)))
    else:
        differ = g != w
    idx = differ.nonzero()
    first = []
    for row in idx[:MAX_SHOWN].tolist():
        at = tuple(row)
        first.append({"index": list(at), "got": _num(g[at]), "expected": _num(w[at])})
    return {"output": i, "dtype": str(g.dtype).removeprefix("torch."), "shape": list(g.shape),
            "elements": g.numel(), "mismatches": int(idx.shape[0]), "first": first}


def _num(t: torch.Tensor) -> float | int:
    return t.item() if not t.dtype.is_floating_point else float(t.float().item())


def format_check(res: dict) -> str:
    """The tool result text."""
    head = f"check at shape {res.get('shape')}: "
    if res.get("errors"):
        where = {"compile": "does not compile", "screen": "refused by the screen",
                 "import": "does not import", "inputs": "no inputs at this shape",
                 "run": "failed when called"}.get(res.get("stage", ""), "failed")
        return head + where + "\n" + "\n".join(f"  - {e}" for e in res["errors"][:10])
    lines = [head + ("matches the reference under the op's policy" if res.get("passed")
                     else "does NOT match")]
    lines += [f"  - {f}" for f in (res.get("findings") or [])[:6]]
    lines += [f"  - {p}" for p in (res.get("policy") or [])[:6]]
    for o in res.get("outputs", []):
        lines.append(f"  output {o['output']} {o['dtype']}{o['shape']}: {o['mismatches']} of "
                     f"{o['elements']} elements differ bitwise from the reference")
        for m in o["first"]:
            lines.append(f"    at {m['index']}: got {m['got']!r}, expected {m['expected']!r}")
    lines.append("(one shape, one seed: the submission's verification checks far more)")
    return "\n".join(lines)


__all__ = ["check_one", "format_check", "mismatches"]
