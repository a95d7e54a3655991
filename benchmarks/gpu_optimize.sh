#!/usr/bin/env bash
# One `autoopt optimize` run on an H200 (~6 minutes): the template agent writes, tunes, verifies
# and times fused Triton kernels for the ops of h200-tp8-decode that it has templates for
# (rmsnorm, norm_residual_norm, qk_norm_rope, qk_norm_ssmax, attn_output_gate, swiglu,
# logit_softcap), accepts the winners into the sm_90 lock of the repo's kernels/ and writes the
# run report with the before/after profile.
#
# Run from the repo root on the GPU machine:   OUT=/some/dir bash benchmarks/gpu_optimize.sh
# Needs optuna there (the H200 image lacks it): carry its wheels (optuna 5 needs alembic, mako,
# colorlog, sqlalchemy, greenlet, tqdm, PyYAML; `pip download optuna -d wheels`), install first:
#   pip install --no-index --find-links wheels optuna
# Knobs: LAYERS (default 4: three dense sliding-window layers and one full-attention MoE layer,
# so every templated op runs), BUDGET (agent-session wall time, default 3m), TRIALS (Optuna
# trials per token bucket, default 6), BACKEND (profiler: torch = CUPTI, fast; ncu = slower),
# REGISTRY (a registry DIR instead of the repo's kernels/; FRESH=1 starts it empty, so every op's
# baseline is the pure-PyTorch reference: the product's from-scratch path).
# Writes under $OUT:
#   runs/<time>-h200-tp8-decode/   report.md, plots/*.png, profile_before.json/.png,
#                                  profile_after.json/.png, state.json, attempts.jsonl,
#                                  ops/<op>/{candidates,optuna.journal,tuning}/, e2e.lock.toml
#   kernels/                       the registry after the run: copy it over the repo's kernels/
#                                  (`git diff kernels/` then shows the new variants, records,
#                                  configs, NOTES.md entries and lock) and commit it
#   optimize.log                   the console output
set -euo pipefail
OUT=${OUT:-$(pwd)/out}
LAYERS=${LAYERS:-4}
BUDGET=${BUDGET:-3m}
TRIALS=${TRIALS:-6}
BACKEND=${BACKEND:-torch}
REGISTRY=${REGISTRY:-kernels}
if [ "${FRESH:-0}" = 1 ]; then rm -rf "$REGISTRY"; mkdir -p "$REGISTRY"; fi
mkdir -p "$OUT/runs"
if ! python3 -c "import optuna" 2>/dev/null; then
    echo "optuna is not installed here: pip install --no-index --find-links <wheels> optuna" >&2
    exit 3
fi
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true

start=$(date +%s)
python3 -m autoopt.cli optimize --target h200-tp8-decode --agent template --layers "$LAYERS" --batch 1 \
    --budget "$BUDGET" --trials "$TRIALS" --max-candidates 2 --verify-seeds 2 --bench-iters 30 \
    --profile-backend "$BACKEND" --auto-accept --runs-dir "$OUT/runs" --registry "$REGISTRY" \
    ${OPS:+--ops "$OPS"} 2>&1 | tee "$OUT/optimize.log"
echo "optimize took $(( $(date +%s) - start )) s"

cp -r "$REGISTRY" "$OUT/kernels"
run_dir=$(ls -d "$OUT"/runs/*-h200-tp8-decode | tail -1)
echo "report: $run_dir/report.md"
echo "registry after the run: $OUT/kernels (copy over kernels/ and commit)"
sed -n '/## Ops by gap/,/## Plots/p' "$run_dir/report.md"
