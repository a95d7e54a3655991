#!/usr/bin/env bash
# One GPU-machine call of the lead's session: phase 1 (GPU tests, kernels, eval
# harness), 2 (profiles, serving benchmark), 3 (optimize loop) or tp (2 GPUs). Everything lands in one tarball under $OUT,
# since at most 8 files come back.
#   bash benchmarks/gpu_session.sh 1|2|3|tp
set -uo pipefail
phase=${1:?phase 1, 2 or tp}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
R=/tmp/res-$phase; rm -rf "$R"; mkdir -p "$R"  # a warm machine keeps /tmp between calls
export AUTOOPT_CACHE=$R/cache
{ nvidia-smi; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"; git log -1 --format=%H 2>/dev/null; } > "$R/machine-$phase.txt" 2>&1
run() {  # run NAME SECONDS CMD...: bounded, logged, never fatal
  local name=$1 secs=$2; shift 2
  echo "== $name (limit ${secs}s) $(date +%T)"
  timeout --kill-after=10 "$secs" "$@" > "$R/$name.log" 2>&1
  echo "== $name exit $? $(date +%T)"; tail -n 25 "$R/$name.log"
}
case $phase in
  1)
    run gpu-tests 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/
    run kernels 150 python3 benchmarks/gpu_kernels.py --out "$R/kernels"
    run eval 100 python3 benchmarks/eval_harness_gpu.py --out "$R/eval"
    ;;
  1b)  # what phase 1 did not finish in its first call
    run gpu-tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 \
      tests/test_kernels_triton_v1.py tests/test_eval_gpu.py tests/test_serve_gpu.py \
      tests/test_profiler_gpu.py tests/test_api_engine.py
    run kernels 170 python3 benchmarks/gpu_kernels.py --out "$R/kernels" \
      --ops attn_output_gate,swiglu,logit_softcap
    run profile 170 python3 benchmarks/gpu_profile.py --out "$R/profile" --budget-s 150
    ;;
  A)  # the second call's results (1b) came back too large to fetch: repeat what it measured
    run kernels 120 python3 benchmarks/gpu_kernels.py --out "$R/kernels" \
      --ops attn_output_gate,swiglu,logit_softcap
    run profile 160 python3 benchmarks/gpu_profile.py --out "$R/profile" --budget-s 130
    run serve 150 python3 benchmarks/serve_bench.py --out "$R/serve"
    run gpu-tests 130 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout=100 \
      tests/test_kernels_triton_v1.py tests/test_serve_gpu.py tests/test_eval_gpu.py
    ;;
  2)
    run profile 230 python3 benchmarks/gpu_profile.py --out "$R/profile" --budget-s 200
    run serve 180 python3 benchmarks/serve_bench.py --out "$R/serve"
    ;;
  3b)  # the first optimize call spent its budget before reaching the qk ops
    run optimize 240 env OUT="$R/optimize2" BUDGET=190s OPS=qk_norm_rope,qk_norm_ssmax \
      bash benchmarks/gpu_optimize.sh
    ;;
  3)
    run optimize 400 env OUT="$R/optimize" BUDGET=3m bash benchmarks/gpu_optimize.sh
    ;;
  tp)
    run tp 280 python3 benchmarks/tp_bench.py --out "$R/tp"
    ;;
  s2a)  # session 2, call 1 (2 GPUs): optimize on GPU 0 while GPU 1 re-measures kernels + ncu
    ( export CUDA_VISIBLE_DEVICES=0
      run optimize 540 env OUT="$R/optimize" BUDGET=420s TRIALS=6 bash benchmarks/gpu_optimize.sh
    ) &
    ( export CUDA_VISIBLE_DEVICES=1
      run kernels 280 python3 benchmarks/gpu_kernels.py --out "$R/kernels" --variants triton_v1 \
        --ops rmsnorm,norm_residual_norm,attn_output_gate,swiglu,logit_softcap,allreduce_norm_residual_norm
      run ncu 220 python3 benchmarks/gpu_profile.py --out "$R/profile" --only decode-b1 \
        --skip-full --ncu-layers 8 --budget-s 200
    ) &
    wait
    ;;
  s2c)  # session 2, call 3: from-scratch optimize on GPU 1; kernels re-measured on GPU 0
    run tp-tests 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_parallel.py \
      tests/test_serve_tp.py
    ( export CUDA_VISIBLE_DEVICES=1 AUTOOPT_CACHE=$R/cache-opt
      run optimize 490 env OUT="$R/optimize" BUDGET=350s TRIALS=6 FRESH=1 \
        REGISTRY=/tmp/fresh-registry bash benchmarks/gpu_optimize.sh
    ) &
    ( export CUDA_VISIBLE_DEVICES=0 AUTOOPT_CACHE=$R/cache-kernels
      run kernels-a 170 python3 benchmarks/gpu_kernels.py --out "$R/kernels" --variants triton_v1 \
        --ops rmsnorm,norm_residual_norm,attn_output_gate
      run kernels-b 170 python3 benchmarks/gpu_kernels.py --out "$R/kernels-b" --variants triton_v1 \
        --ops swiglu,logit_softcap,allreduce_norm_residual_norm
      export FLASHINFER_WORKSPACE_BASE=/tmp/fi-cache
      run fi-diag 100 python3 benchmarks/flashinfer_engine_diag.py --out "$R/fi-diag"
      run fi-tests 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_serve_flashinfer.py
    ) &
    wait
    ;;
  s2d)  # session 2, call 4: resume the from-scratch run (registry rebuilt from its evidence),
        # time the fused TP boundary for its record, re-run the FlashInfer engine test
    run_dir=/tmp/res-s2c/optimize/runs/20261130-085956-h200-tp8-decode
    mkdir -p "$(dirname "$run_dir")" && cp -r .resume/run "$run_dir" && cp -r .resume/fresh-registry /tmp/fresh-registry
    ( export CUDA_VISIBLE_DEVICES=1 AUTOOPT_CACHE=$R/cache-opt
      run resume 270 python3 -m autoopt.cli optimize --resume "$run_dir"
      cp -r "$run_dir" "$R/run"; cp -r /tmp/fresh-registry "$R/fresh-registry"
    ) &
    ( export CUDA_VISIBLE_DEVICES=0 AUTOOPT_CACHE=$R/cache-kernels
      run kernels-arn 200 python3 benchmarks/gpu_kernels.py --out "$R/kernels" --variants triton_v1 \
        --ops allreduce_norm_residual_norm
      export FLASHINFER_WORKSPACE_BASE=/tmp/fi-cache
      run fi-tests 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_serve_flashinfer.py \
        -k near_ties
    ) &
    wait
    ;;
  s2b)  # session 2, call 2 (2 GPUs): TP2 over NCCL, then FlashInfer and the GPU tests
    run tp 170 python3 benchmarks/tp_bench.py --out "$R/tp" --timeout 150 \
      --fused kernels/allreduce_norm_residual_norm/triton_v1.py
    run tp-tests 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_parallel.py \
      tests/test_serve_tp.py
    export FLASHINFER_WORKSPACE_BASE=/tmp/fi-cache
    ( export CUDA_VISIBLE_DEVICES=0
      run flashinfer 200 python3 benchmarks/flashinfer_check.py --out "$R/flashinfer" --budget-s 180
      run fi-tests 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_serve_flashinfer.py
    ) &
    ( export CUDA_VISIBLE_DEVICES=1
      run gpu-tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout=150 \
        tests/test_kernels_triton_v1.py tests/test_serve_gpu.py tests/test_eval_gpu.py
    ) &
    wait
    ;;
esac
# Nsight report files are large (over the 16 MiB a fetched file may have): keep their summaries.
tar czf "$OUT/results-$phase.tgz" --exclude='*.ncu-rep' --exclude='*.nsys-rep' -C "$R" . && ls -la "$OUT"
