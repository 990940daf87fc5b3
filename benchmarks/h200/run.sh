#!/bin/bash
# GPU runs on the H200 device machine (wheels per ../shared/gpu/README.md; kvtide's own
# wheel, built by stage-kvtide.sh, carried in .gpu/kvtide; with VLLM029=1, vLLM 0.29 + torch 2.13
# staged by stage-vllm029.sh, so that Ray Serve LLM's ray_kv and ray_prefix run too). Each stage works in /tmp/work
# and leaves at most a few files in $OUT (the device returns 8 at most): its report, its
# JSON and one tarball of logs.
#   (stage first: bash benchmarks/h200/stage-all.sh)
#   bash benchmarks/h200/run.sh placement      N TP=1 replicas on N GPUs; 4 replicas on 2 GPUs (x2 kind)
#   bash benchmarks/h200/run.sh overhead-demo  kvtide direct / ingress vs bare vLLM, demo model, one GPU
#                                              (SERVERS, CONCURRENCY, NUM_REQUESTS, OVERHEAD_DURATION narrow it;
#                                              REPEATS alternated measured starts per server, default 3, each after
#                                              one unmeasured warm-up start: benchmarks/protocol.py)
#   bash benchmarks/h200/run.sh overhead-8b    the same with a Llama-3.1-8B-shaped model built on the device
#                                              (TTFT_PATHS=N: first N rounds of one stream's TTFT by path; issue 49's
#                                              hand-over: SERVERS=kvtide-vllm-layer,kvtide-vllm-layer-rendered,vllm)
#   bash benchmarks/h200/run.sh overhead-8b-inline  kvtide alone, its routing peer tokenizing on the event loop
#                                              (router_tokenize_threads=0; CONCURRENCY_AB, default 16,64)
#   bash benchmarks/h200/run.sh overhead-8b-peer    Ray Serve LLM alone (direct streaming, default router), same levels
#   bash benchmarks/h200/run.sh overhead-8b-peers2  kvtide alone with two routing peers per node (bursts of consults)
#   bash benchmarks/h200/run.sh consult-8b     the routing peer's consult batch by batch as it routes more (8B shape),
#                                              py-spy on the peer meanwhile (CONSULT_BATCHES, CONSULT_PROFILE_AFTER_S)
#   bash benchmarks/h200/run.sh routing        `kvtide bench compare` on the x2 kind: 4 replicas of the 8B shape
#                                              (2 per GPU), bare / pow2 / prefix_aware / round_robin, Zipf
#                                              shared-prefix at several open-loop rates (POLICIES, RATES, ...)
#   bash benchmarks/h200/run.sh trace          `kvtide bench trace` (vllm bench serve) on the Mooncake trace: prefix_aware /
#                                              bare round robin, REPEATS fresh starts each (TRACE_POLICIES, TRACE_SCALES, ...)
#   bash benchmarks/h200/run.sh profile-8b     bare vLLM's closed-loop levels at long prompts, for `kvtide simulate fit`
#                                              (PROFILE_INPUT_LENS, default "2048 6000"; PROFILE_CONCURRENCY)
#   bash benchmarks/h200/run.sh warm           one unmeasured start of the routing fleet (compile caches), before routing
#   bash benchmarks/h200/run.sh agentic        `kvtide bench agentic` on that fleet: agent sessions (tools; chat, Messages,
#                                              Responses), prefix_aware / pow2 / bare, REPEATS starts each
#                                              (AGENTIC_POLICIES, AGENTIC_SESSIONS, AGENTIC_LEVELS)
#   bash benchmarks/h200/run.sh routing-multiturn the same fleet on multi-turn conversations (MULTITURN_POLICIES, _RATES)
#   bash benchmarks/h200/run.sh routing-random the same fleet on random prompts (routing must not hurt;
#                                              RANDOM_POLICIES, RANDOM_RATES)
#   bash benchmarks/h200/run.sh routing-all    the three loads above in one compare, one cluster start per policy
#   bash benchmarks/h200/run.sh agreement      two routing peers per node (independent routers), tie band on / off,
#                                              beside one peer: shared-prefix and multi-turn (POLICIES, RATES)
#                                              (POLICIES, RATES for shared-prefix, MULTITURN_RATES, RANDOM_RATES)
#   bash benchmarks/h200/run.sh autoscale      step load, replicas 1 -> 4 (AUTOSCALE_MIN/_MAX; AUTOSCALE_GPU_SHARE each, demo model): kv, kv-cold,
#                                              queue_length, fixed-max -> autoscale.json, report.md, timeline.png
#   bash benchmarks/h200/run.sh standby        issue 34 on the 8B shape, one GPU (AUTOSCALE_GPU_SHARE each): the step
#                                              load with VARIANTS (kv-standby,kv,queue_length), then the scale-down
#                                              episode (cache_aware vs ray, shifted Zipf load; SCALE_DOWN=0 skips it,
#                                              STEP_LOAD=0 the step load);
#                                              GPU memory and RSS per engine process every 2 s (standby-memory.txt).
#                                              On one GPU the replicas share its compute (a woken standby adds KV,
#                                              not compute); on the x4 kind AUTOSCALE_GPU_SHARE=1 gives each its own
#                                              (x2: AUTOSCALE_GPU_SHARE=1 AUTOSCALE_MAX=2). AUTOSCALE_MAX=2 on one
#                                              GPU: the wake fills the cap (1 active + 1 standby), so no refill or
#                                              later cold start shares the GPU during the step; every variant ends
#                                              at two engines and differs only in when the second serves (seen:
#                                              one 8B engine keeps the GPU busy at HIGH_RATE 6, so the second
#                                              engine on it served the step worse, not better).
#   bash benchmarks/h200/run.sh kv-tier        issue 51's CPU KV tier (benchmarks/kv_tier.py), one GPU: kvtide with the tier,
#                                              kvtide without it, bare vLLM with it behind round robin; 2 replicas of the 8B
#                                              shape each, prefix-revisit load; REPEATS (3) alternated fresh starts per server
#                                              (KV_TIER_SERVERS, KV_TIER_RATE, KV_TIER_ROUNDS, KV_TIER_GPU_KV_BYTES,
#                                              KV_TIER_CPU_GIB, KV_TIER_WARMUP_START=1, KV_TIER_SET; the stage's comment)
#   bash benchmarks/h200/run.sh lora-logprobs  prompt logprobs among other requests with LoRA adapters enabled, kvtide
#                                              and bare vLLM (demo model) -> lora-logprobs/report.md
#   bash benchmarks/h200/run.sh preload        Ray's worker preload of vLLM and a new replica's start (no GPU used;
#                                              the node's 16 CPUs as Ray's) -> preload/report.md
#   bash benchmarks/h200/run.sh start STAGES   run the stages in order in the background (one session's
#                                              device time is a few device calls: the driver outlives a call).
#                                              On a fresh machine this call first installs the wheels: 1-5 min
#                                              (seen: 54 s, and once over 4 min), so give the call a 600 s limit
#   bash benchmarks/h200/run.sh stop           stop the driver, its servers, HAProxy and Ray (then `start` again)
#   bash benchmarks/h200/run.sh poll SECONDS   wait for the background driver (at most SECONDS), then pack
#                                              what it wrote so far into $OUT/results.tar.gz
set -uo pipefail
export VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KVTIDE_HOME=/tmp/kvtide-home
bash .gpu/extra/install.sh >/dev/null || exit 1
if [ ! -d /tmp/kvt/kvtide ]; then
  mkdir -p /tmp/kvt && python3 -m zipfile -e .gpu/kvtide/kvtide-*.whl /tmp/kvt || exit 1
fi
# The repo root is NOT on the path: its kvtide/ folder holds only the namespace root.
export PYTHONPATH=/tmp/kvt:/tmp/site
# provenance of every result (benchmarks/protocol.py): the commit the wheel was built from (stage-kvtide.sh)
[ -f .gpu/kvtide/COMMIT ] && export KVTIDE_COMMIT=$(cat .gpu/kvtide/COMMIT)
if [ "${VLLM029:-0}" = 1 ]; then  # vLLM 0.29 + torch 2.13 (stage-vllm029.sh) shadow the 0.26 set
  if [ ! -d /tmp/site2/vllm ]; then
    mkdir -p /tmp/wheels029 && cat /tmp/wn/npart-* | tar xif - -C /tmp/wheels029 &&  # -i: parts may hold several tars
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 /tmp/wheels029/*.whl || exit 1
    PYTHONPATH=/tmp/site2:/tmp/site PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 python3 -c \
      "import torch, vllm, ray.llm, dynamo; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.is_available())" || exit 1
  fi
  export PYTHONPATH=/tmp/kvt:/tmp/site2:/tmp/site
  export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1  # torch 2.13 was built with cuDNN 9.20; the image has 9.19
fi
OUT=${OUT:-/tmp/out}
W=/tmp/work
RES=/tmp/results  # what `poll` packs: every stage's reports, JSON and logs
mkdir -p "$OUT" "$W" "$RES"
cd /tmp  # away from the checkout's kvtide/ folder
REPO=$OLDPWD

gpu_of_pids() {  # "pid gpu_index used_MiB" per compute process
  nvidia-smi --query-gpu=index,uuid --format=csv,noheader | tr -d ' ' > /tmp/gpus.csv
  nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader | tr -d ' ' |
    while IFS=, read -r pid uuid mem; do echo "$pid $(grep "$uuid" /tmp/gpus.csv | cut -d, -f1) $mem"; done
}

serve_and_snapshot() {  # name, extra --set args...: serve, record which GPU each engine uses, stop
  local name=$1; shift
  python3 -m kvtide.cluster.cli serve --config "$REPO/config/presets/gpu-demo.yaml" --set engine.enforce_eager=true \
      --set http.port=8300 --set metrics.port=8390 "$@" > "$W/$name-serve.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 200); do grep -q "kvtide: ready" "$W/$name-serve.log" && break; kill -0 $pid || break; sleep 2; done
  curl -s http://127.0.0.1:8300/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": "kvtide-demo", "prompt": "def placement():", "max_tokens": 8}' > "$W/$name-response.json"
  { echo "## $name: nvidia-smi while serving (pid gpu_index used_memory)"; gpu_of_pids; echo; nvidia-smi;
    echo "response: $(cat "$W/$name-response.json")"; } >> "$OUT/placement.txt"
  local t0=$(date +%s)
  kill -TERM $pid; wait $pid; echo "## $name: SIGTERM -> exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/placement.txt"
  sleep 2; { echo "## $name: compute processes after the stop"; gpu_of_pids; echo; } >> "$OUT/placement.txt"
}

# ROUTING_GPU_SHARE: GPU per replica (0.5: two per GPU on the x2 kind; 0.25: all four on one GPU);
# ROUTING_KV_BYTES: KV cache per replica. Default 6 GiB (49k tokens of the 8B shape): the 20 system prompts (120k tokens) are
# 2.4x one replica's cache and fit the fleet with room for running requests; at 4 GiB they filled
# it exactly and under overload every policy's hit rate collapsed (h200-session-2026-12-01b)
ROUTING_SHARE=${ROUTING_GPU_SHARE:-0.5}
# ROUTING_REPLICAS: engine replicas (4; 8 on the x8 kind at ROUTING_GPU_SHARE=1); ROUTING_SET: more --set
# arguments for every policy's fleet (e.g. "--set engine.tensor_parallel_size=2" for 4 replicas x TP2 on 8 GPUs)
ROUTING_REPLICAS=${ROUTING_REPLICAS:-4}
# shellcheck disable=SC2206  # ROUTING_SET is split into words on purpose
FLEET_8B=(--set model=/tmp/models/llama-8b-shape --set served_model_name=llama-8b-shape ${ROUTING_SET:-}
  --set replicas.num_replicas="$ROUTING_REPLICAS" --set resources.gpus_per_worker="$ROUTING_SHARE" --set engine.gpu_memory_utilization=null
  --set engine.kv_cache_memory_bytes="${ROUTING_KV_BYTES:-6442450944}" --set engine.max_model_len=8192 --set engine.max_num_seqs=64
  --set engine.max_num_batched_tokens=8192 --set http.port=8300 --set metrics.port=8390)

gpu_label() {  # "N × <GPU name>" as nvidia-smi names it (the kind lent may be an H100 or an H200); $1: N used
  echo "${1:-$(nvidia-smi -L | wc -l)} × $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
}

build_8b() {
  python3 "$REPO/benchmarks/h200/build_model.py" /tmp/models/llama-8b-shape > "$W/build-8b.log" 2>&1 || { tail "$W/build-8b.log"; exit 1; }
}

leftovers() {  # a stage must not start on GPUs that a previous one's engines still hold
  local left; left=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | tr -d ' ')
  if [ -n "$left" ]; then
    echo "leftover compute processes before $1: $left" | tee -a "$RES/driver-notes.txt"
    echo "$left" | xargs -r kill -9; sleep 3
  fi
  # an HAProxy left by a stopped run holds the HTTP port: the next Serve's HAProxy then crashes at start
  left=$(pgrep -x haproxy)
  if [ -n "$left" ]; then echo "leftover haproxy before $1: $left" | tee -a "$RES/driver-notes.txt"; echo "$left" | xargs -r kill -9; fi
}

startup_stacks() {  # py-spy dumps of engine replica processes in their first 90 s, every 3 s: where start-up goes
  while true; do
    for pid in $(pgrep -f "EngineCore|ServeReplica:kvtide:Engine"); do
      age=$(ps -o etimes= -p "$pid" 2>/dev/null | tr -d ' ')
      { [ -n "$age" ] && [ "$age" -lt 90 ]; } || continue
      { echo "=== $(date +%T.%N) pid $pid age ${age}s $(ps -o args= -p "$pid" | cut -c1-80)"
        /tmp/site/bin/py-spy dump -p "$pid" 2>&1 | head -60; } >> "$RES/startup-stacks.txt"
    done
    sleep 3
  done
}

stop_driver() {  # the driver's session, then what runs in sessions of its own (servers, HAProxy, Ray)
  kill -- "-$(cat "$RES/driver.pid")" 2>/dev/null
  python3 -c "import ray.scripts.scripts as s, sys; sys.argv = ['ray', 'stop', '--force']; s.main()" > /dev/null 2>&1
  # by exact name or bracketed patterns: a plain `pkill -f` pattern also matches the shell of the
  # device call whose command line names it (seen: the call died with rc -1)
  pgrep -x haproxy | xargs -r kill -9
  pgrep -f "kvtide[.]benchmarks|kvtide[.]cluster|vllm[.]entrypoints|EngineCor[e]" | xargs -r kill -9
}

compare() {  # out name, policies, workload, rates, extra args...
  local name=$1 policies=$2 workload=$3 rates=$4; shift 4
  mkdir -p "$RES/$name"
  python3 -m kvtide.cluster.cli bench compare --config "$REPO/config/presets/gpu-demo.yaml" "${FLEET_8B[@]}" \
      --policies "$policies" --workload "$workload" --rate "$rates" --duration "${DURATION:-15}" \
      --tokenizer /tmp/models/llama-8b-shape --slo-ttft-s 1.0 --metrics-settle 20 --drain-timeout 20 --no-progress \
      --repeats "${REPEATS:-1}" \
      --hardware "$(gpu_label), $ROUTING_REPLICAS engine replicas of a Llama-3.1-8B-shaped model (random weights)${ROUTING_SET:+ ($ROUTING_SET)}, $ROUTING_SHARE GPU and $(( ${ROUTING_KV_BYTES:-6442450944} / 1073741824 )) GiB KV each, vLLM $(python3 -c 'import vllm; print(vllm.__version__)' 2>/dev/null)" \
      --out "$RES/$name" "$@" > "$RES/$name/compare.log" 2>&1
  echo "$name: exit $?" >> "$RES/driver-notes.txt"
}

case "${1:-placement}" in
start)  # the stages run in a copy: the next device call replaces the checkout under a running script
  shift
  rm -rf /tmp/drv && mkdir -p /tmp/drv "$RES" && cp -r "$REPO/benchmarks" "$REPO/config" /tmp/drv/ && mkdir /tmp/drv/.gpu && cp -r "$REPO/.gpu/extra" "$REPO/.gpu/kvtide" /tmp/drv/.gpu/
  # The driver records its own pid: under setsid it leads its session and process group, which
  # `poll` stops (setsid forks first when called from a group leader, so $! would be wrong).
  (cd /tmp/drv && setsid nohup bash -c "echo \$\$ > $RES/driver.pid; for s in $*; do echo \"== \$s \$(date +%T)\"; OUT=$RES bash benchmarks/h200/run.sh \$s; done; echo \"== done \$(date +%T)\"" \
      > "$RES/driver.log" 2>&1 < /dev/null &)
  setsid nohup nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv -l 2 \
      > "$RES/gpu-util.csv" 2>/dev/null < /dev/null &
  sleep 2; cat "$RES/driver.log"
  ;;
stop)  # stop the driver and everything it started (before a restart in the same session)
  stop_driver; sleep 2; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
  ;;
poll)  # poll SECONDS [PATTERN]: also stops the driver once PATTERN shows in a compare log (device time is finite)
  for i in $(seq 1 "${2:-60}"); do
    grep -q "^== done" "$RES/driver.log" 2>/dev/null && break
    # only this driver's logs: a stopped earlier driver's logs may hold the pattern already
    if [ -n "${3:-}" ] && find "$RES" -name compare.log -newer "$RES/driver.pid" -exec grep -qh "$3" {} + 2>/dev/null; then
      # The driver's session, then what runs in sessions of its own (bare vLLM servers, HAProxy);
      # not "run.sh" by name: that would match this poll too.
      echo "poll: '$3' seen: stopping the driver"; stop_driver; break
    fi
    (( i % 30 == 0 )) && tar czf "$OUT/results.tar.gz" --exclude='*.requests.jsonl' -C "$RES" .
    sleep 1
  done
  tail -25 "$RES/driver.log"; cat "$RES/driver-notes.txt" 2>/dev/null
  for f in "$RES"/*/report.md; do [ -f "$f" ] && { echo "## $f"; head -60 "$f"; }; done
  tar czf "$OUT/results.tar.gz" --exclude='*.requests.jsonl' -C "$RES" .
  tar czf "$OUT/samples.tar.gz" -C "$RES" $(cd "$RES" && find . -name '*.requests.jsonl') 2>/dev/null
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
  ;;
preload)  # does a replica Serve adds find vLLM imported in its worker? (benchmarks/worker_preload.py)
  mkdir -p "$RES/preload"
  python3 -m kvtide.benchmarks.worker_preload --out-dir "$RES/preload" --num-cpus "$(nproc)" > "$RES/preload/run.log" 2>&1
  echo "preload: exit $?" >> "$RES/driver-notes.txt"
  ;;
lora-logprobs)  # prompt logprobs among other requests on an engine with LoRA adapters, kvtide and bare vLLM (demo model)
  leftovers lora-logprobs; mkdir -p "$RES/lora-logprobs"
  python3 -m kvtide.benchmarks.lora_prompt_logprobs --config "$REPO/config/presets/gpu-demo.yaml" \
      --set 'lora={"adapters": {"demo-sql": "demo", "demo-chat": "demo"}, "max_loras": 2, "max_lora_rank": 8}' \
      --hardware "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
      --out-dir "$RES/lora-logprobs" > "$RES/lora-logprobs/run.log" 2>&1
  echo "lora-logprobs: exit $?" >> "$RES/driver-notes.txt"
  ;;
routing)
  build_8b; leftovers routing
  compare routing-shared-prefix "${POLICIES:-bare,pow2,prefix_aware,round_robin}" shared-prefix "${RATES:-8,16,32}" \
      --zipf-s 0.8 --num-groups 20 --prompts-per-group 64 --system-prompt-len 6000 --question-len 128 --output-len 64
  ;;
autoscale)  # AUTOSCALE_GPU_SHARE: GPU per replica (0.5 = two per GPU on the x2; 0.25 = four on one GPU)
  leftovers autoscale
  startup_stacks & stacks=$!
  ngpu=$(nvidia-smi -L | wc -l); share=${AUTOSCALE_GPU_SHARE:-0.5}; kv=${AUTOSCALE_KV_BYTES:-33554432}
  amin=${AUTOSCALE_MIN:-1}; amax=${AUTOSCALE_MAX:-4}  # 2 and 8 on the x8 kind (#14)
  # AUTOSCALE_8B=1: the 8B shape instead of the demo model, so that a hot prefix's prefill costs
  # something a warm start can save (set AUTOSCALE_KV_BYTES, e.g. 2147483648, and TRACE_ARGS'
  # --hot-prefix-words, e.g. 4000); the demo model prefills 500 words in ~1 ms on an H200.
  model=(--set engine.max_model_len=2048); what="demo model"
  if [ "${AUTOSCALE_8B:-0}" = 1 ]; then
    build_8b; what="Llama-3.1-8B shape"
    model=(--set model=/tmp/models/llama-8b-shape --set served_model_name=llama-8b-shape --set engine.max_model_len=8192)
  fi
  python3 -m kvtide.benchmarks.autoscale --config "$REPO/config/presets/gpu-demo.yaml" "${model[@]}" \
      --set replicas.num_replicas=null --set replicas.min_replicas="$amin" --set replicas.max_replicas="$amax" \
      --set resources.gpus_per_worker="$share" --set engine.gpu_memory_utilization=null \
      --set engine.kv_cache_memory_bytes="$kv" --set autoscaling.max_step=3 \
      --set http.port=8300 --set metrics.port=8390 --variants "${VARIANTS:-kv,queue_length,kv-cold,fixed-max}" \
      --high-rate "${HIGH_RATE:-20}" --queue-target-ongoing "${QUEUE_TARGET:-2}" --warm-caches ${TRACE_ARGS:-} \
      --hardware "$(gpu_label), $what, $amin to $amax replicas ($share GPU and $((kv / 1048576)) MiB of KV each)" \
      --out-dir "$RES/autoscale" > "$RES/autoscale.log" 2>&1
  echo "autoscale: exit $?" >> "$RES/driver-notes.txt"
  kill $stacks
  # Each replica's start-up by phase is in autoscale.json (the exported gauge); its log line goes
  # to the replica's Serve log file, which Serve buffers (it may not be flushed before a stop).
  grep -h "start-up:" /tmp/ray/session_*/logs/serve/replica_*.log > "$RES/start-phases.txt" 2>/dev/null
  ;;
standby)
  build_8b; leftovers standby
  ngpu=$(nvidia-smi -L | wc -l); share=${AUTOSCALE_GPU_SHARE:-0.25}; kv=${AUTOSCALE_KV_BYTES:-2147483648}
  fleet=(--set model=/tmp/models/llama-8b-shape --set served_model_name=llama-8b-shape --set engine.max_model_len=8192
         --set resources.gpus_per_worker="$share" --set engine.gpu_memory_utilization=null
         --set http.port=8300 --set metrics.port=8390)
  hw="$(gpu_label), Llama-3.1-8B shape, $share GPU per replica"
  # What a sleeping engine holds: each GPU process's memory and each engine process's RSS, every 2 s.
  ( while true; do ts=$(date +%s); gpu_of_pids | sed "s/^/$ts gpu /"
      ps -eo pid,ppid,rss,args | grep -E "VLLM|EngineCore|ServeReplica" | grep -v grep | cut -c1-120 | sed "s/^/$ts ps /"
      sleep 2; done ) > "$RES/standby-memory.txt" 2>&1 &
  mem=$!
  # The step load first (its variants are the issue's headline numbers), then the scale-down episode.
  # The hot prefix: 2,500 words is ~6.5k tokens of the demo tokenizer (~2.6 per word), inside max_model_len 8192.
  if [ "${STEP_LOAD:-1}" = 1 ]; then  # STEP_LOAD=0: the scale-down episode only
  # shellcheck disable=SC2086  # TRACE_ARGS is split into words on purpose
  python3 -m kvtide.benchmarks.autoscale --config "$REPO/config/presets/gpu-demo.yaml" "${fleet[@]}" \
      --set replicas.num_replicas=null --set replicas.min_replicas=1 --set replicas.max_replicas="${AUTOSCALE_MAX:-4}" \
      --set engine.kv_cache_memory_bytes="$kv" --set autoscaling.max_step=3 \
      --variants "${VARIANTS:-kv-standby,kv,queue_length}" --high-rate "${HIGH_RATE:-6}" \
      --queue-target-ongoing "${QUEUE_TARGET:-2}" ${TRACE_ARGS:---low-s 20 --high-s 120 --tail-s 40 --hot-prefix-words 2500} \
      --hardware "$hw, 1 to ${AUTOSCALE_MAX:-4} replicas, $((kv / 1048576)) MiB of KV each" \
      --out-dir "$RES/autoscale" > "$RES/autoscale.log" 2>&1
  echo "autoscale: exit $?" >> "$RES/driver-notes.txt"
  fi
  if [ "${SCALE_DOWN:-1}" = 1 ]; then  # SCALE_DOWN=0: the step load only
  leftovers standby-scale-down
  # The shifted load (scale_down.py --shift-at-s): SCALE_DOWN_GROUPS (24) prompts of SCALE_DOWN_WORDS words (1,200
  # is ~3.1k tokens, 75k in all, inside the fleet's 3 x 49k), each cached once, then only those last
  # served by the replica Ray would stop. A scale-down comes at low load: at SCALE_DOWN_RATE 0.5 req/s
  # the first pass takes ~48 s, hence the shift at 55 s and a 90 s downscale delay. One-token
  # requests, so enforce_eager (no CUDA graphs, which only decode uses) shortens each cluster's start.
  # (h200-standby-2026-12-04b ran 600 words at 1 req/s, shift 30 s, delay 60 s.) SHIFT_DRAW=uniform draws
  # the kept prompts alike after the shift (zipf: the hottest of them takes most draws).
  python3 -m kvtide.benchmarks.scale_down --config "$REPO/config/presets/gpu-demo.yaml" "${fleet[@]}" \
      --set engine.kv_cache_memory_bytes="${SCALE_DOWN_KV_BYTES:-6442450944}" --set engine.enforce_eager=true \
      --set autoscaling.downscale_delay_s="${SCALE_DOWN_DELAY_S:-90}" --rate "${SCALE_DOWN_RATE:-0.5}" \
      --groups "${SCALE_DOWN_GROUPS:-24}" --prefix-words "${SCALE_DOWN_WORDS:-1200}" --shift-at-s "${SHIFT_AT_S:-55}" --window-s 60 \
      --shift-draw "${SHIFT_DRAW:-zipf}" \
      --hardware "$hw, 6 GiB of KV each" --out-dir "$RES/autoscale" > "$RES/scale_down.log" 2>&1
  echo "scale_down: exit $?" >> "$RES/driver-notes.txt"
  fi
  kill $mem
  grep -h "start-up:\|role:" /tmp/ray/session_*/logs/serve/replica_*.log > "$RES/start-phases.txt" 2>/dev/null
  ;;
agentic)  # issue 49: agent sessions with tools through chat, Messages and Responses on the routing fleet:
  # prefix_aware / pow2 / bare round robin, each started fresh per repeat (order rotated), two levels of sessions
  build_8b; leftovers agentic
  mkdir -p "$RES/agentic"
  python3 -m kvtide.cluster.cli bench agentic --config "$REPO/config/presets/gpu-demo.yaml" "${FLEET_8B[@]}" \
      --policies "${AGENTIC_POLICIES:-prefix_aware,pow2,bare}" --resend-history --repeats "${REPEATS:-3}" \
      --sessions "${AGENTIC_SESSIONS:-60}" --sessions-in-flight "${AGENTIC_LEVELS:-16,50}" \
      --tokenizer /tmp/models/llama-8b-shape \
      --hardware "$(gpu_label), $ROUTING_REPLICAS engine replicas of a Llama-3.1-8B-shaped model (random weights)" \
      --out-dir "$RES/agentic" > "$RES/agentic/agentic.log" 2>&1
  echo "agentic: exit $?" >> "$RES/driver-notes.txt"
  ;;
trace)  # issue 48: the shared Mooncake trace at its timestamps, replayed by vLLM's own `vllm bench serve` (aiperf's
  # dependencies are not carried), against TRACE_POLICIES' fleets of the 8B shape, each started fresh per repeat
  # (order rotated): TRACE_REPLICAS replicas at TRACE_GPU_SHARE GPU and TRACE_KV_BYTES of KV each (default 2 x 0.5
  # GPU x 16 GiB: four 8B engines do not fit one H100 beside their KV). Window TRACE_START_S + TRACE_DURATION_S of
  # the trace, TRACE_BLOCK_TOKENS per hash id, at each of TRACE_SCALES (timestamp multipliers: 0.5 = twice its rate).
  build_8b; leftovers trace
  mkdir -p "$RES/trace"
  n=${TRACE_REPLICAS:-2}; share=${TRACE_GPU_SHARE:-0.5}; kv=${TRACE_KV_BYTES:-17179869184}
  python3 -m kvtide.cluster.cli bench trace --config "$REPO/config/presets/gpu-demo.yaml" \
      --set model=/tmp/models/llama-8b-shape --set served_model_name=llama-8b-shape \
      --set replicas.num_replicas="$n" --set resources.gpus_per_worker="$share" --set engine.gpu_memory_utilization=null \
      --set engine.kv_cache_memory_bytes="$kv" --set engine.max_model_len=8192 --set engine.max_num_batched_tokens=8192 \
      --set http.port=8300 --set metrics.port=8390 \
      --policies "${TRACE_POLICIES:-prefix_aware,bare}" --repeats "${REPEATS:-3}" --client vllm-bench \
      --tokenizer /tmp/models/llama-8b-shape --trace "$REPO/.gpu/kvtide/mooncake-synthetic.jsonl" \
      --block-tokens "${TRACE_BLOCK_TOKENS:-64}" --max-input-tokens 7936 --over-long truncate --max-output-tokens 128 \
      --start-s "${TRACE_START_S:-800}" --duration-s "${TRACE_DURATION_S:-100}" --time-scale "${TRACE_SCALES:-0.8,0.5}" \
      --slo-ttft-ms 1000 --metrics-settle-s 20 \
      --hardware "$(gpu_label), $n engine replicas of a Llama-3.1-8B-shaped model (random weights), $share GPU and $((kv / 1073741824)) GiB KV each, vLLM $(python3 -c 'import vllm; print(vllm.__version__)' 2>/dev/null)" \
      --out-dir "$RES/trace" > "$RES/trace/trace.log" 2>&1
  echo "trace: exit $?" >> "$RES/driver-notes.txt"
  ;;
warm)  # one unmeasured cluster of the routing fleet first: the compile caches the measured runs then share
  build_8b; leftovers warm
  DURATION=5 compare warm pow2 shared-prefix 2 --num-groups 4 --prompts-per-group 4 --system-prompt-len 2000 \
      --question-len 64 --output-len 16
  ;;
routing-multiturn)  # 48 users x 6 rounds, each user's history (up to ~3k tokens) outgrows a fair share of one cache
  build_8b; leftovers routing-multiturn
  DURATION=${MULTITURN_DURATION:-30} compare routing-multiturn "${MULTITURN_POLICIES:-pow2,prefix_aware}" multi-turn \
      "${MULTITURN_RATES:-16}" --num-users 48 --num-rounds 6 --system-prompt-len 1024 --question-len 256 --output-len 64
  ;;
routing-random)
  build_8b; leftovers routing-random
  compare routing-random "${RANDOM_POLICIES:-pow2,prefix_aware}" random "${RANDOM_RATES:-16}" \
      --num-requests 2000 --input-len 2048 --output-len 64
  ;;
agreement)  # routers that share no state: two routing peers per node (HAProxy alternates its consults between
  # them), with and without routing.tie_band_tokens, beside one peer; shared-prefix and multi-turn
  build_8b; leftovers agreement
  compare agreement "${POLICIES:-prefix_aware+http.router_replicas_per_node=2,prefix_aware+http.router_replicas_per_node=2+routing.tie_band_tokens=0,prefix_aware}" \
      "${AGREEMENT_WORKLOADS:-shared-prefix,multi-turn}" "${RATES:-8}" --zipf-s 0.8 --num-groups 20 --prompts-per-group 64 --system-prompt-len 6000 \
      --question-len 128 --output-len 64 --num-users 48 --num-rounds 6 \
      --workload-set multi-turn.system_prompt_len=1024 --workload-set multi-turn.question_len=256 \
      --workload-set multi-turn.rate="${MULTITURN_RATES:-16}" --workload-set multi-turn.duration="${MULTITURN_DURATION:-30}"
  ;;
routing-all)  # the three routing loads on one cluster start per policy (a start of the 8B fleet is ~100 s)
  build_8b; leftovers routing-all
  compare routing-all "${POLICIES:-pow2,prefix_aware,ray_prefix,ray_kv,bare}" shared-prefix,multi-turn,random \
      "${RATES:-8}" --zipf-s 0.8 --num-groups 20 --prompts-per-group 64 --system-prompt-len 6000 --question-len 128 \
      --output-len 64 --num-users 48 --num-rounds 6 --num-requests 2000 --input-len 2048 \
      --workload-set multi-turn.system_prompt_len=1024 --workload-set multi-turn.question_len=256 \
      --workload-set multi-turn.rate="${MULTITURN_RATES:-16}" --workload-set multi-turn.duration="${MULTITURN_DURATION:-30}" \
      --workload-set random.rate="${RANDOM_RATES:-8}"
  ;;
kv-tier)  # issue 51: a CPU KV tier per engine replica (vLLM's native offloading), benchmarks/kv_tier.py on one GPU.
  # Servers: kvtide-tier (kvtide, engine.kv_offload.size_gib=KV_TIER_CPU_GIB), kvtide (the same without the tier: the
  # TTFT target's baseline), vllm-offload (bare vLLM with the same offloading flags behind round robin). Each: 2 engine
  # replicas of the 8B shape at 0.5 GPU (0.45 of it claimed; 15 GiB of weights each), KV_TIER_GPU_KV_BYTES of GPU KV
  # (default 4 GiB: 32,768 tokens at the shape's 128 KiB per token), and on the tier servers KV_TIER_CPU_GIB of host
  # memory each (default 16: 131,072 tokens; /dev/shm must hold 2 x that, checked first). Load: prefix-revisit,
  # 24 prefixes of ~4,096 tokens = ~98k tokens (3x one replica's GPU KV, 1.5x the fleet's, 0.75x one replica's
  # tier), each back after 16-30 other requests (windows of 8): evicted from any GPU cache before it returns, kept by
  # the tier. The first round is unmeasured; KV_TIER_ROUNDS-1 rounds (default 3: 72 requests) are measured open loop
  # at KV_TIER_RATE req/s. REPEATS fresh starts per server, alternated (3 x 3 = 9 starts: the starts are most of the
  # stage's time). KV_TIER_SERVERS=kvtide-tier,kvtide drops the bare server's starts; adding kvtide-tier-blind (the same
  # tiers routed on GPU blocks alone: what the tier-aware cost adds; the simulator found none) costs 3 starts more; KV_TIER_WARMUP_START=1 adds the
  # protocol's unmeasured start per server. enforce_eager: 16 output tokens per request make CUDA graphs worth
  # little, and every start then skips compilation and graph capture.
  build_8b; leftovers kv-tier
  rm -f /dev/shm/vllm_offload_*.mmap  # tier files of engines a stopped run killed: no process is left to own them
  mkdir -p "$RES/kv-tier"
  gkv=${KV_TIER_GPU_KV_BYTES:-4294967296}; cgib=${KV_TIER_CPU_GIB:-16}
  { df -B1 /dev/shm; free -g; } > "$RES/kv-tier/host-memory.txt" 2>&1
  warm_start=(); [ "${KV_TIER_WARMUP_START:-0}" = 1 ] && warm_start=(--warmup-start)
  # shellcheck disable=SC2086  # KV_TIER_SET is split into words on purpose
  CUDA_VISIBLE_DEVICES=0 python3 -m kvtide.benchmarks.kv_tier --config "$REPO/config/presets/gpu-demo.yaml" \
      --set model=/tmp/models/llama-8b-shape --set served_model_name=llama-8b-shape \
      --set replicas.num_replicas=2 --set resources.gpus_per_worker=0.5 --set engine.gpu_memory_utilization=null \
      --set engine.kv_cache_memory_bytes="$gkv" --set engine.max_model_len=8192 --set engine.max_num_seqs=64 \
      --set engine.max_num_batched_tokens=8192 --set engine.enforce_eager=true \
      --set http.port=8300 --set metrics.port=8390 ${KV_TIER_SET:-} \
      --tier-set engine.kv_offload.size_gib="$cgib" \
      --servers "${KV_TIER_SERVERS:-kvtide-tier,kvtide,vllm-offload}" --repeats "${REPEATS:-3}" "${warm_start[@]}" \
      --num-groups 24 --system-prompt-len 4096 --question-len 64 --output-len 16 --revisit-window 8 \
      --num-rounds "${KV_TIER_ROUNDS:-4}" --rate "${KV_TIER_RATE:-4}" --duration 120 --drain-timeout 30 \
      --metrics-settle 20 --slo-ttft-s "${KV_TIER_SLO_TTFT_S:-1.0}" --tokenizer /tmp/models/llama-8b-shape \
      --hardware "$(gpu_label 1), 2 engine replicas per server of a Llama-3.1-8B-shaped model (random weights), 0.5 GPU and $((gkv / 1048576)) MiB of GPU KV each, ${cgib} GiB of CPU tier each on the tier servers, vLLM $(python3 -c 'import vllm; print(vllm.__version__)' 2>/dev/null)" \
      --no-progress --out-dir "$RES/kv-tier" > "$RES/kv-tier/compare.log" 2>&1
  rc=$?; echo "kv-tier: exit $rc" >> "$RES/driver-notes.txt"
  # a failed start's reason is in its Serve replica logs (kvtide's servers log under Ray's session folders)
  [ "$rc" = 0 ] || tar czf "$RES/kv-tier/serve-logs.tar.gz" /tmp/ray/session_*/logs/serve 2>/dev/null
  rm -f /dev/shm/vllm_offload_*.mmap
  ;;
placement)
  serve_and_snapshot tp1-x2 --set replicas.num_replicas=2
  serve_and_snapshot share-x4 --set replicas.num_replicas=4 --set resources.gpus_per_worker=0.5 \
      --set engine.gpu_memory_utilization=null --set engine.kv_cache_memory_bytes=8589934592
  tar czf "$OUT/placement-logs.tar.gz" -C "$W" .
  ;;
overhead-demo)
  leftovers overhead-demo
  CUDA_VISIBLE_DEVICES=0 python3 -m kvtide.benchmarks.overhead --config "$REPO/config/presets/gpu-demo.yaml" \
      --servers "${SERVERS:-kvtide,kvtide-ingress,vllm}" --concurrency "${CONCURRENCY:-1,16,64}" \
      --num-requests "${NUM_REQUESTS:-200}" \
      --duration "${OVERHEAD_DURATION:-60}" --input-len 512 --output-len 128 --hardware "$(gpu_label 1), demo model" \
      --repeats "${REPEATS:-3}" \
      --no-progress --out-dir "$RES/overhead-demo" > "$RES/overhead-demo.log" 2>&1
  tail -15 "$RES/overhead-demo/report.md"
  ;;
overhead-8b|overhead-8b-inline|overhead-8b-peer|overhead-8b-peers2)
  # -inline: kvtide alone with the routing peer tokenizing on its event loop (router_tokenize_threads=0),
  # the A/B of the default's tokenizer threads; -peer: Ray Serve LLM (direct streaming, default router);
  # -peers2: kvtide alone with two routing peers per node (http.router_replicas_per_node=2), all levels.
  build_8b; leftovers "$1"
  case "$1" in
    overhead-8b-inline) servers=kvtide; extra=(--set http.router_tokenize_threads=0); conc=${CONCURRENCY_AB:-16,64} ;;
    overhead-8b-peers2) servers=kvtide; extra=(--set http.router_replicas_per_node=2); conc=${CONCURRENCY:-1,16,64} ;;
    overhead-8b-peer) servers=ray-serve-llm; extra=(); conc=${CONCURRENCY:-1,16,64} ;;
    *) servers=${SERVERS:-kvtide,vllm}; extra=(); conc=${CONCURRENCY:-1,16,64} ;;
  esac
  CUDA_VISIBLE_DEVICES=0 python3 -m kvtide.benchmarks.overhead --config "$REPO/config/presets/gpu-demo.yaml" \
      --set model=/tmp/models/llama-8b-shape --set served_model_name=llama-8b-shape \
      --set engine.gpu_memory_utilization=0.85 --set engine.max_num_seqs=128 "${extra[@]}" \
      --servers "$servers" --concurrency "$conc" --num-requests "${NUM_REQUESTS:-200}" \
      --duration "${OVERHEAD_DURATION:-60}" --input-len 512 --output-len 128 --ttft-paths "${TTFT_PATHS:-0}" \
      --repeats "${REPEATS:-3}" \
      --hardware "$(gpu_label 1), Llama-3.1-8B shape, random weights" \
      --no-progress --out-dir "$RES/$1" > "$RES/$1.log" 2>&1
  tail -15 "$RES/$1/report.md"
  ;;
profile-8b)  # issue 50: bare vLLM alone, one engine of the 8B shape, closed loop at PROFILE_INPUT_LENS prompt tokens
  # (each a run of its own), for `kvtide simulate fit` (runs of several prompt lengths tell KV reads from decodes
  # and pin long prefills, which the 512-token overhead run cannot)
  build_8b; leftovers profile-8b
  for len in ${PROFILE_INPUT_LENS:-2048 6000}; do
    CUDA_VISIBLE_DEVICES=0 python3 -m kvtide.benchmarks.overhead --config "$REPO/config/presets/gpu-demo.yaml" \
        --set model=/tmp/models/llama-8b-shape --set served_model_name=llama-8b-shape \
        --set engine.gpu_memory_utilization=0.85 --set engine.max_num_seqs=128 --set engine.max_model_len=8192 \
        --servers vllm --concurrency "${PROFILE_CONCURRENCY:-1,8,32}" --num-requests "${NUM_REQUESTS:-100}" \
        --duration "${OVERHEAD_DURATION:-15}" --input-len "$len" --output-len 128 --repeats "${REPEATS:-1}" \
        --hardware "$(gpu_label 1), Llama-3.1-8B shape, random weights" \
        --no-progress --out-dir "$RES/profile-8b-$len" > "$RES/profile-8b-$len.log" 2>&1
    echo "profile-8b $len: exit $?" >> "$RES/driver-notes.txt"
  done
  ;;
profile)  # where the direct path spends CPU at 64 streams: py-spy on the engine replica and HAProxy's view
  python3 -m kvtide.cluster.cli serve --config "$REPO/config/presets/gpu-demo.yaml" --replicas 1 \
      --set http.port=8300 --set metrics.port=8390 > "$W/profile-serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 200); do grep -q "kvtide: ready" "$W/profile-serve.log" && break; kill -0 $pid || break; sleep 2; done
  python3 - > "$W/profile-load.log" 2>&1 <<'PY' &
import asyncio
from kvtide.benchmarks.loadgen import run_load
from kvtide.benchmarks.workloads import build_workload, make_params
w = build_workload("random", make_params("random", num_requests=2000, input_len=512, output_len=128), seed=64)
r = asyncio.run(run_load("http://127.0.0.1:8300", w.requests, concurrency=64, duration_s=40, model="kvtide-demo",
                         endpoint="completions", progress=False))
print(len(r.results), sum(x.num_output_tokens for x in r.results) / r.duration_s, "tok/s")
PY
  load=$!
  sleep 12
  eng=$(pgrep -f "ServeReplica:kvtide:Engine" | head -1)
  top -b -n 1 -w 200 | head -30 > "$OUT/profile-top.txt"
  /tmp/site/bin/py-spy record -d 15 -r 200 -p "$eng" --format speedscope -o "$W/engine.speedscope.json" > /dev/null 2>&1
  /tmp/site/bin/py-spy dump -p "$eng" > "$W/engine-dump.txt" 2>&1
  python3 "$REPO/benchmarks/h200/speedscope_top.py" "$W/engine.speedscope.json" > "$OUT/profile-engine-top.txt"
  wait $load; cat "$W/profile-load.log" >> "$OUT/profile-top.txt"
  kill -TERM $pid; wait $pid
  tar czf "$OUT/profile.tar.gz" -C "$W" engine.speedscope.json engine-dump.txt profile-serve.log profile-load.log
  ;;
consult-8b)  # the routing peer's consult as it routes more requests (8B shape, the overhead run's flags), and
  # py-spy (--gil: what holds the loop, as in results/consult-cpu-burst-profile) on the peer while it answers:
  # which part of a consult grows (h200-session-2026-12-03b: 2.0 -> 3.5 ms)
  build_8b; leftovers consult-8b
  mkdir -p "$RES/consult-8b"
  python3 -m kvtide.cluster.cli serve --config "$REPO/config/presets/gpu-demo.yaml" --replicas 1 \
      --set model=/tmp/models/llama-8b-shape --set served_model_name=llama-8b-shape \
      --set engine.gpu_memory_utilization=0.85 --set engine.max_num_seqs=128 \
      --set http.port=8300 --set metrics.port=8390 > "$W/consult-serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 200); do grep -q "kvtide: ready" "$W/consult-serve.log" && break; kill -0 $pid || break; sleep 2; done
  python3 -m kvtide.benchmarks.ttft_paths consults --model llama-8b-shape --batches "${CONSULT_BATCHES:-10}" \
      --per-batch 100 > "$RES/consult-8b/batches.txt" 2>&1 &
  batches=$!
  sleep "${CONSULT_PROFILE_AFTER_S:-20}"
  peer=$(pgrep -f "ServeReplica:kvtide:Router" | head -1)
  /tmp/site/bin/py-spy record -d 15 -r 500 --gil -p "$peer" --format speedscope -o "$W/peer.speedscope.json" > /dev/null 2>&1
  python3 "$REPO/benchmarks/h200/speedscope_top.py" "$W/peer.speedscope.json" > "$RES/consult-8b/peer-top.txt"
  wait $batches
  kill -TERM $pid; wait $pid
  tar czf "$RES/consult-8b/peer-profile.tar.gz" -C "$W" peer.speedscope.json consult-serve.log
  cat "$RES/consult-8b/batches.txt"; head -30 "$RES/consult-8b/peer-top.txt"
  ;;
esac
