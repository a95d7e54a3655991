"""Why a kernel is slow: Nsight Compute sections for one op's variant, and what reads can reach.

    python benchmarks/ncu_kernels.py --op moe_experts --variant triton_v1 --tokens 1,8 --out DIR
    python benchmarks/ncu_kernels.py --op moe_experts,router/triton_v1 --tokens 1 --reads --out DIR

1. `ncu` (launch statistics, occupancy, speed of light, memory workload, warp states) over one
   call per T at a TP8 rank's shapes, after warm-up calls outside the NVTX range; clocks and
   caches left as the GPU has them (`--clock-control none --cache-control none`), so the L2
   holds what the warm-up left (the inputs rotate over sets that exceed it). DIR/ncu-OP-T.txt
   is ncu's details page.
2. `--reads`: CUDA-graph timings of plain reads (torch sums) of 5 MB to 1 GB and of an empty
   launch, rotating over buffers beyond the L2: what one kernel that reads N bytes costs on this
   GPU, beside the op's floor (bytes over the 1 GB copy bandwidth). DIR/reads.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RANGE = "autoopt_ncu_op"
SECTIONS = ("LaunchStats", "Occupancy", "SpeedOfLight", "MemoryWorkloadAnalysis",
            "WarpStateStats", "SchedulerStats")


def op_call(op: str, variant: str, t: int, device: str):
    """(fn, [args, ...]) at the rank's shapes: several sets, so warm-up does not leave the
    profiled call's weights in the L2."""
    from model.registry import Registry

    if op not in ("moe_experts", "router"):
        raise SystemExit(f"--op must be moe_experts or router, not {op!r}")
    fn = Registry().load_variant(op, variant).run
    g = torch.Generator(device=device).manual_seed(t)
    if op == "moe_experts":
        from benchmarks.moe_gpu import RANK, SCALE, make_tokens, make_weights

        sets = []
        for _ in range(4):
            gu, dn = make_weights(RANK, device, g)
            x, w, ids = make_tokens(t, RANK, device, g)
            sets.append((x, gu, dn, w, ids, SCALE))
        return fn, sets
    h_dim, e = 5120, 256  # the router
    sets = []
    for _ in range(16):  # 5.2 MB of FP32 weights each: 84 MB in all
        h = torch.randn(t, h_dim, device=device, generator=g).to(torch.bfloat16)
        wt = torch.randn(e, h_dim, device=device, generator=g) * h_dim**-0.5
        bias = torch.randn(e, device=device, generator=g) * 0.01
        sets.append((h, wt, bias, 8, 4, 8))
    return fn, sets


def child(op: str, variant: str, t: int) -> None:
    fn, sets = op_call(op, variant, t, "cuda")
    for args in sets[1:]:  # compile and warm up on the other sets
        fn(*args)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(RANGE)
    fn(*sets[0])
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


def run_ncu(op: str, variant: str, t: int, out: Path) -> str:
    from autoopt.profiler.nsight import _child_env, find_ncu

    ncu = find_ncu()
    if ncu is None:
        return "ncu not found"
    rep = out / f"ncu-{op}-{t}"
    cmd = [ncu, "--nvtx", "--nvtx-include", f"{RANGE}/", "--clock-control", "none",
           "--cache-control", "none", "--force-overwrite", "-o", str(rep)]
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += [sys.executable, __file__, "--child", "--op", op, "--variant", variant,
            "--tokens", str(t)]
    env = {**_child_env(), "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                      os.environ.get("PYTHONPATH")]))}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if res.returncode != 0:
        return f"ncu failed ({res.returncode}): {(res.stdout + res.stderr)[-2000:]}"
    page = subprocess.run([ncu, "--import", f"{rep}.ncu-rep", "--page", "details"],
                          capture_output=True, text=True, timeout=300)
    text = page.stdout + page.stderr
    (out / f"ncu-{op}-{t}.txt").write_text(text)
    return text


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # One program sums a contiguous CHUNK of bf16 in BLOCK steps: 16-byte loads, one FP32 out.
    base = tl.program_id(0).to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(0, CHUNK, BLOCK):
        offs = base + i + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def triton_read(x: torch.Tensor, out: torch.Tensor, chunk: int) -> torch.Tensor:
    _read_kernel[(triton.cdiv(x.numel(), chunk),)](x, out, x.numel(), CHUNK=chunk, BLOCK=2048,
                                                   num_warps=4)
    return out


def reads(out: Path) -> dict:
    """Graph-replayed plain reads of N bytes (rotating beyond the L2) and an empty launch."""
    from autoopt.eval import time_callable
    from autoopt.eval.timing import measure_ceilings

    ceil = measure_ceilings("cuda", refresh=True)
    rows = []
    for mb in (5.24, 26.2, 52.4, 78.6, 1024):
        n = int(mb * 1e6) // 2
        count = max(2, int(400e6 // (n * 2)) + 1)
        bufs = [(torch.ones(n, dtype=torch.bfloat16, device="cuda"),) for _ in range(count)]
        row = {"MB": mb, "floor_us": mb * 1e6 / ceil.copy_bytes_s * 1e6}
        fns = {"torch.sum": lambda a: a.sum(dtype=torch.float32)}
        for chunk in (16384, 65536):  # 32 KB / 128 KB a program
            part = torch.empty(triton.cdiv(n, chunk), dtype=torch.float32, device="cuda")
            fns[f"triton {chunk * 2 >> 10} KB/program"] = \
                lambda a, part=part, chunk=chunk: triton_read(a, part, chunk)
        for name, fn in fns.items():
            tm = time_callable(fn, bufs, device="cuda", warmup=3, iters=30)
            row[name] = {"us": tm.median_us, "iqr_us": tm.iqr_us,
                         "TB_s": mb * 1e6 / (tm.median_us * 1e-6) / 1e12}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del bufs
    z = torch.zeros(1, device="cuda")
    tm = time_callable(lambda a: a.add_(0), [(z,)], device="cuda", warmup=3, iters=30)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "copy_TB_s": ceil.copy_bytes_s / 1e12,
           "empty_launch_us": tm.median_us, "reads": rows}
    (out / "reads.json").write_text(json.dumps(res, indent=1))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", default="moe_experts", help="OP[/VARIANT],... ('' for none)")
    ap.add_argument("--variant", default="triton_v1")
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--reads", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.op, a.variant, int(a.tokens))
        return 0
    if a.out is None:
        ap.error("--out is required")
    if not torch.cuda.is_available():
        print("no GPU here: Nsight Compute profiles GPU kernels only")
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    for spec in filter(None, a.op.split(",")):  # OP or OP/VARIANT
        op, _, variant = spec.partition("/")
        for t in (int(x) for x in a.tokens.split(",")):
            text = run_ncu(op, variant or a.variant, t, a.out)
            print(f"== {op}/{variant or a.variant} T={t}\n{text[-6000:]}", flush=True)
    if a.reads:
        print(json.dumps(reads(a.out), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
