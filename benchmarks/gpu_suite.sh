#!/usr/bin/env bash
# Named GPU stages in one bounded call on a CUDA machine without network access: each stage runs
# under its own time limit, logs to its own file, and never stops the stages after it; every
# result lands in one directory that is packed into at most a few tarballs under $OUT.
#
#   OUT=DIR [SUITE_S=SECONDS] bash benchmarks/gpu_suite.sh STAGE[=SECONDS] ...
#   (run it from the repository root; `bash benchmarks/gpu_suite.sh list` prints the stages)
#
# SUITE_S bounds the whole call: each stage runs under the smaller of its own limit and what is
# left of SUITE_S (less 20 s for packing), so a stage that finishes early leaves its time to the
# next, and a stage with no time left is skipped and says so. A stage's command sees its own
# limit as STAGE_S (bench-step and bench-model size their budgets from it). Both compare the tuned
# set with benchmarks/moe-only.lock.toml (the reference kernels with a capturable MoE, replayed
# from a CUDA graph as served) unless STEP_SETS / PROFILE_ARGS say otherwise: the reference MoE
# syncs with the host, so the reference set runs eagerly, at hundreds of ms per step.
#
# `tune` verifies and proposes the best configs of this call's sweeps (sweep, sweep2, sweep3),
# after those of TUNE_SWEEPS (results.json files of earlier calls, carried in the tree): a bucket
# in both takes this call's.
# Packages the machine lacks travel as wheels: .whl/*.whl (small ones; benchmarks/gpu_wheels.py
# fetches them), .whl-fi/*.whl
# (FlashInfer) are installed into a scratch site directory first. nvidia-cutlass-dsl is too large
# for one transfer: `dsl-stash` keeps the parts carried in .dsl/ in a scratch directory that a
# machine keeps for a short while after a call, and `dsl` joins them with the parts of the next
# call and unpacks the DSL (parts made with `tar | xz | split` from a `pip install --target`).
# NVLink multicast stays off for every stage (NCCL, PyTorch symmetric memory, NVSHMEM).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SUITE_START=$(date +%s)
SCRATCH=${TMPDIR:-/tmp}/autoopt-gpu-suite
DSL_PARTS=$SCRATCH/dsl-parts
R=$SCRATCH/results
mkdir -p "$SCRATCH" "$DSL_PARTS"
rm -rf "$R" && mkdir -p "$R"
export AUTOOPT_CACHE=$R/cache

declare -A STAGES=(
  [machine]="nvidia-smi; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'; git log -1 --format=%H 2>/dev/null || true"
  [tests]="AUTOOPT_TEST_FAILURES=\$R/tests-failures.log python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider --continue-on-collection-errors --durations=20 \$(python3 -c 'import pytest_timeout' 2>/dev/null && echo --timeout=\${GPU_TEST_TIMEOUT:-240}) \${GPU_TESTS:-tests/}"
  [kernels]="python3 benchmarks/gpu_kernels.py --out \$R/kernels \${KERNELS_ARGS:-}"
  [kernels2]="python3 benchmarks/gpu_kernels.py --out \$R/kernels2 \${KERNELS2_ARGS:-}"
  [kernels3]="python3 benchmarks/gpu_kernels.py --out \$R/kernels3 \${KERNELS3_ARGS:-}"
  [ncu]="python3 benchmarks/ncu_kernels.py --out \$R/ncu \${NCU_ARGS:-}"
  [moe]="python3 benchmarks/moe_gpu.py --out \$R/moe \${MOE_ARGS:-}"
  [reduction]="python3 benchmarks/reduction_check.py --out \$R/reduction \${REDUCTION_ARGS:-}"
  [moe-ep]="python3 benchmarks/moe_ep_check.py --out \$R/moe-ep \${MOE_EP_ARGS:-}"
  [sweep]="python3 benchmarks/config_sweep_gpu.py --out \$R/sweep \${SWEEP_ARGS:-}"
  [sweep2]="python3 benchmarks/config_sweep_gpu.py --out \$R/sweep2 \${SWEEP2_ARGS:-}"
  [sweep3]="python3 benchmarks/config_sweep_gpu.py --out \$R/sweep3 \${SWEEP3_ARGS:-}"
  [tune]="c=\$(python3 benchmarks/sweep_best.py \${TUNE_SWEEPS:-} \$(ls \$R/sweep*/results.json 2>/dev/null)) && python3 -m autoopt.cli registry tune \${TUNE_ARGS:?set TUNE_ARGS, e.g. router triton_v5 --target h200-tp8-decode} --configs \"\$c\""
  [router]="python3 benchmarks/router_cute_gpu.py --out \$R/router \${ROUTER_ARGS:-}"
  [attention]="python3 benchmarks/attention_gpu.py --out \$R/attention \${ATTENTION_ARGS:-}"
  [eval]="python3 benchmarks/eval_harness_gpu.py --out \$R/eval \${EVAL_ARGS:-}"
  [verify]="mkdir -p \$R/verify && python3 -m autoopt.cli verify --device cuda --json \${VERIFY_ARGS:?set VERIFY_ARGS, e.g. --op attention --variant triton_v1 --secret HEX} > \$R/verify/report.json; tail -c 2000 \$R/verify/report.json"
  [bench-model]="python3 benchmarks/gpu_profile.py --out \$R/bench-model --budget-s \$((STAGE_S - 30)) \${PROFILE_ARGS:---baseline benchmarks/moe-only.lock.toml}"
  [bench-step]="python3 -m autoopt.cli bench model --target h200-tp8-decode --context 8192 --kernels \${STEP_SETS:-benchmarks/moe-only.lock.toml,tuned} --row-s 8 --budget \$((STAGE_S - 45))s --out \$R/bench-step \${STEP_ARGS:-}"
  [profile]="for b in \${PROFILE_BATCHES:-8 32 64}; do python3 -m autoopt.cli profile --target h200-tp8-decode --kernels tuned --context \${PROFILE_CONTEXT:-100000} --batch \$b --out \$R/profile/bs\$b \${PROFILE_STEP_ARGS:-} || echo \"profile at batch \$b failed\"; done"
  [agents]="python3 benchmarks/agents_gpu.py --out \$R/agents"
  [accept]="python3 benchmarks/gpu_accept.py \${ACCEPT_ARGS:-} && mkdir -p \$R/registry-after && cp -r kernels/. \$R/registry-after/"
  [batch-invariant]="python3 benchmarks/batch_invariant_bench.py --out \$R/batch-invariant \${BI_ARGS:-}"
  [tp]="python3 benchmarks/tp8_run.py --gpus \$(nvidia-smi -L | wc -l) --out \$R/tp \${TP_ARGS:-}"
  [optimize]="python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . && cd \$R && export AUTOOPT_RUNS_DIR=\$R/runs && t0=\$(date +%s) && autoopt optimize \${OPTIMIZE_ARGS:---budget 5m}; echo \"wall \$((\$(date +%s) - t0)) s\""
  [dsl-stash]="cp .dsl/part-* \$DSL_PARTS/ && ls -la \$DSL_PARTS"
  [dsl]="cp .dsl/part-* \$DSL_PARTS/ 2>/dev/null; mkdir -p \$SCRATCH/dsl && cat \$DSL_PARTS/part-* | xz -d | tar -x -C \$SCRATCH/dsl && python3 -c 'import cutlass, cutlass.cute; print(\"cutlass-dsl imports\")'"
)

if [ "${1:-}" = list ]; then
  for s in "${!STAGES[@]}"; do echo "$s: ${STAGES[$s]}"; done | sort
  exit 0
fi
: "${OUT:?set OUT to the directory results are written to}"

SITE=$SCRATCH/site
for dir in .whl .whl-fi; do
  if ls "$dir"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$dir"/*.whl || echo "installing $dir failed"
  fi
done
export PYTHONPATH=$SITE:$SCRATCH/dsl:$SCRATCH/dsl/nvidia_cutlass_dsl/dsl_packages:$PWD

run_stage() {  # run_stage NAME SECONDS: bounded, logged, never fatal
  local name=$1 secs=$2 cmd=${STAGES[$1]:-}
  if [ -z "$cmd" ]; then echo "== unknown stage $name (bash $0 list)"; return; fi
  if [ -n "${SUITE_S:-}" ]; then
    local left=$((SUITE_S - 20 - ($(date +%s) - SUITE_START)))
    if [ "$left" -lt 10 ]; then echo "== $name skipped: SUITE_S=${SUITE_S} is spent"; return; fi
    [ "$left" -lt "$secs" ] && secs=$left
  fi
  echo "== $name (limit ${secs}s) $(date +%T)"
  (cd "$PWD" && STAGE_S=$secs timeout --kill-after=15 "$secs" bash -c "$cmd") > "$R/$name.log" 2>&1
  echo "== $name exit $? $(date +%T)"
  tail -n "${TAIL_LINES:-30}" "$R/$name.log"
}

pack() {  # at most 8 files come back, 16 MiB each: one tarball, split when larger
  rm -f "$OUT"/results.tar.gz*
  (cd "$R/.." && tar -czf "$OUT/results.tar.gz" --exclude=results/cache results) && \
    if [ "$(stat -c %s "$OUT/results.tar.gz")" -gt 15000000 ]; then
      split -b 15000000 "$OUT/results.tar.gz" "$OUT/results.tar.gz.part-" && \
        rm "$OUT/results.tar.gz"
    fi
}

export R SCRATCH DSL_PARTS
for spec in "$@"; do  # NAME[=SECONDS], or A+B[=SECONDS] to run stages side by side
  names=${spec%%=*}
  secs=${spec#*=}
  [ "$secs" = "$spec" ] && secs=300
  for name in ${names//+/ }; do run_stage "$name" "$secs" & done
  wait
  # A judge's workers run in sessions of their own: one whose judge was cut off by a stage's
  # limit must not hold the GPU's memory into the next stage.
  if pkill -9 -f "autoopt[.]eval[.]worker" 2>/dev/null; then echo "== killed workers left by $spec"; fi
  pack  # after every stage: a call cut short still returns what finished
done
ls -la "$OUT"
