#!/bin/bash
# GPU runs on the H200 device machine (see ../shared/gpu/README.md for the wheel recipe).
#   bash benchmarks/h200/run.sh smoke      TP=2 engine replica over 2 GPUs serves a request
#   bash benchmarks/h200/run.sh overhead   kvtide vs bare vLLM vs Ray Serve LLM, one GPU
set -uo pipefail
export VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KVTIDE_HOME=/tmp/kvtide-home
bash .gpu/extra/install.sh >/dev/null || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}
case "${1:-smoke}" in
smoke)
  python3 -c "from deployments.demo_model import build_demo_model; print(build_demo_model())" || exit 1
  python3 -m cluster.cli serve --config cluster/configs/gpu-tp2.yaml --set model=demo \
      --set served_model_name=kvtide-demo --set engine.max_model_len=4096 --set engine.enforce_eager=true \
      --set replicas.min_replicas=null --set replicas.max_replicas=null --set replicas.num_replicas=1 \
      --set engine.gpu_memory_utilization=0.3 --set ingress.num_replicas=1 --set http.host=127.0.0.1 \
      > "$OUT/tp2-serve.log" 2>&1 &
  pid=$!
  for i in $(seq 1 150); do grep -q "kvtide: ready" "$OUT/tp2-serve.log" && break; kill -0 $pid || break; sleep 2; done
  curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": "kvtide-demo", "prompt": "def tensor_parallel():", "max_tokens": 8}' | tee "$OUT/tp2-response.json"
  echo
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee "$OUT/tp2-nvidia-smi.csv"
  kill -INT $pid; wait $pid
  grep -E "kvtide:|Error|error" "$OUT/tp2-serve.log" | grep -v "^$" | tail -20
  ;;
overhead)
  python3 -m benchmarks.overhead --config cluster/configs/gpu-demo.yaml --concurrency 1,16 \
      --num-requests "${NUM_REQUESTS:-200}" --duration "${DURATION:-45}" --input-len 512 --output-len 64 \
      --no-progress --out "$OUT/overhead-h200.md" > "$OUT/overhead.log" 2>&1
  tail -25 "$OUT/overhead-h200.md"
  ;;
esac
