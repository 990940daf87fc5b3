{{/*
Helpers shared by the templates. The cross-field checks live here ("kvtide.validate"):
values.schema.json rejects wrong types, unknown keys and unknown enum values; what JSON
schema cannot state is a `fail` with a message naming the field, the bad value and the fix.
*/}}

{{- define "kvtide.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{/*
Resource name prefix. Kept to 40 characters: KubeRay derives RayCluster, pod and Service
names from the RayService name and appends suffixes of its own.
*/}}
{{- define "kvtide.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvtide.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvtide.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvtide.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvtide.labels" -}}
helm.sh/chart: {{ include "kvtide.chart" . }}
{{ include "kvtide.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvtide.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
Ports. The defaults repeat config/'s (HttpConfig.port, MetricsConfig.port) for a
values file that deletes the key; the rendered args then omit it and the model applies the
same default, so pods and Serve agree.
*/}}
{{- define "kvtide.httpPort" -}}
{{- $http := .Values.kvtide.http | default dict }}
{{- int (hasKey $http "port" | ternary (get $http "port") 8000) }}
{{- end }}

{{- define "kvtide.metricsPort" -}}
{{- $metrics := .Values.kvtide.metrics | default dict }}
{{- int (hasKey $metrics "port" | ternary (get $metrics "port") 8080) }}
{{- end }}

{{- define "kvtide.tensorParallelSize" -}}
{{- $engine := .Values.kvtide.engine | default dict }}
{{- int (hasKey $engine "tensor_parallel_size" | ternary (get $engine "tensor_parallel_size") 1) }}
{{- end }}

{{/*
The name clients send as `model`; mirrors KvtideConfig.model_name.
*/}}
{{- define "kvtide.modelName" -}}
{{- if .Values.kvtide.served_model_name }}
{{- .Values.kvtide.served_model_name }}
{{- else if eq (.Values.kvtide.model | default "demo") "demo" }}
{{- "kvtide-demo" }}
{{- else }}
{{- .Values.kvtide.model | default "demo" | trimSuffix "/" | splitList "/" | last }}
{{- end }}
{{- end }}

{{/*
Engine replica bounds from kvtide.replicas, as YAML {autoscaling, min, max}.
"Not set" is an absent key (Helm deletes keys whose value is null when merging maps) or a
null (kept inside lists); `index` returns nil for both.
  num_replicas only         -> fixed: min = max = num_replicas
  min_replicas+max_replicas -> autoscaling
  nothing                   -> the model's default, fixed 1
*/}}
{{- define "kvtide.engineReplicas" -}}
{{- $r := .Values.kvtide.replicas | default dict }}
{{- $hasNum := not (kindIs "invalid" (index $r "num_replicas")) }}
{{- $hasMin := not (kindIs "invalid" (index $r "min_replicas")) }}
{{- $hasMax := not (kindIs "invalid" (index $r "max_replicas")) }}
{{- if and $hasNum (or $hasMin $hasMax) }}
{{- fail (printf "kvtide.replicas: num_replicas=%v (fixed) is given together with min_replicas/max_replicas (autoscaling); give one form. The chart's defaults set min_replicas/max_replicas, so for a fixed count also write `min_replicas: null` and `max_replicas: null`" (get $r "num_replicas")) }}
{{- end }}
{{- if $hasNum }}
autoscaling: false
min: {{ int (get $r "num_replicas") }}
max: {{ int (get $r "num_replicas") }}
{{- else if and $hasMin $hasMax }}
{{- $min := int (get $r "min_replicas") }}
{{- $max := int (get $r "max_replicas") }}
{{- if gt $min $max }}
{{- fail (printf "kvtide.replicas.min_replicas=%d is above kvtide.replicas.max_replicas=%d; make min_replicas <= max_replicas" $min $max) }}
{{- end }}
autoscaling: true
min: {{ $min }}
max: {{ $max }}
{{- else if or $hasMin $hasMax }}
{{- fail "kvtide.replicas: autoscaling needs both min_replicas and max_replicas (or set num_replicas for a fixed count)" }}
{{- else }}
autoscaling: false
min: 1
max: 1
{{- end }}
{{- end }}

{{/*
Pod counts of one worker group, as YAML {gpusPerPod, minReplicas, maxReplicas}.
Call with (dict "root" $ "group" $group "index" $i).
An engine replica's tensor-parallel workers must share a pod (one node, NVLink, one
placement group), so gpusPerPod is a multiple of TP and a pod holds gpusPerPod/TP engines,
or gpusPerPod x floor(1/gpus_per_worker) engines when TP=1 replicas share GPUs:
  pods = ceil(engine replicas / engines per pod)
The first group carries the minimum; every group can grow to the maximum.
*/}}
{{- define "kvtide.workerGroupSize" -}}
{{- $root := .root }}
{{- $g := .group }}
{{- $field := printf "workerGroups[%d]" (int .index) }}
{{- $tp := int (include "kvtide.tensorParallelSize" $root) }}
{{- $gpus := $tp }}
{{- if not (kindIs "invalid" (index $g "gpusPerPod")) }}{{ $gpus = int $g.gpusPerPod }}{{ end }}
{{- if ne (mod $gpus $tp) 0 }}
{{- fail (printf "%s.gpusPerPod=%d is not a multiple of kvtide.engine.tensor_parallel_size=%d: an engine replica's %d GPUs must sit in one pod. Set gpusPerPod to %d, %d, ... (up to the GPUs of one node) or change tensor_parallel_size" $field $gpus $tp $tp $tp (mul 2 $tp)) }}
{{- end }}
{{- $share := float64 (dig "resources" "gpus_per_worker" 1.0 $root.Values.kvtide) }}
{{- $enginesPerGpu := int (floor (divf 1.0 $share)) }}
{{- $enginesPerPod := mul (div $gpus $tp) $enginesPerGpu }}
{{- $engines := include "kvtide.engineReplicas" $root | fromYaml }}
{{- $min := 0 }}
{{- if eq (int .index) 0 }}
{{- $min = div (add (int $engines.min) (sub $enginesPerPod 1)) $enginesPerPod }}
{{- end }}
{{- $max := div (add (int $engines.max) (sub $enginesPerPod 1)) $enginesPerPod }}
{{- if and (not $engines.autoscaling) (ne (int .index) 0) }}
{{- $max = 0 }}
{{- end }}
{{- if not (kindIs "invalid" (index $g "minReplicas")) }}{{ $min = int $g.minReplicas }}{{ end }}
{{- if not (kindIs "invalid" (index $g "maxReplicas")) }}{{ $max = int $g.maxReplicas }}{{ end }}
{{- if gt $min $max }}
{{- fail (printf "%s (%s): minReplicas=%d is above maxReplicas=%d; make minReplicas <= maxReplicas" $field $g.name $min $max) }}
{{- end }}
gpusPerPod: {{ $gpus }}
minReplicas: {{ $min }}
maxReplicas: {{ $max }}
{{- end }}

{{/*
Cross-field checks the schema cannot express. Included once, from rayservice.yaml.
*/}}
{{- define "kvtide.validate" -}}
{{- $resources := .Values.kvtide.resources | default dict }}
{{- $device := hasKey $resources "device" | ternary (get $resources "device") "gpu" }}
{{- if ne $device "gpu" }}
{{- fail (printf "kvtide.resources.device=%s: this chart runs engines on GPU worker pods; set device: gpu (for CPU, run `kvtide serve` outside Kubernetes)" $device) }}
{{- end }}
{{- if eq (include "kvtide.httpPort" .) (include "kvtide.metricsPort" .) }}
{{- fail (printf "kvtide.http.port and kvtide.metrics.port are both %s; give the metrics export its own port" (include "kvtide.httpPort" .)) }}
{{- end }}
{{- $_ := include "kvtide.engineReplicas" . }}
{{- $seen := dict }}
{{- range $i, $g := .Values.workerGroups }}
{{- if hasKey $seen $g.name }}
{{- fail (printf "workerGroups[%d].name=%s is used twice; worker group names must be unique" $i $g.name) }}
{{- end }}
{{- $_ := set $seen $g.name true }}
{{- $_ := include "kvtide.workerGroupSize" (dict "root" $ "group" $g "index" $i) }}
{{- end }}
{{- include "kvtide.validateGcsFaultTolerance" . }}
{{- end }}

{{/*
GCS fault tolerance needs a Redis address, and KubeRay rejects a RayCluster that also
passes Redis settings by hand (rayStartParams, env); say so at template time instead.
*/}}
{{- define "kvtide.validateGcsFaultTolerance" -}}
{{- $ft := .Values.gcsFaultTolerance | default dict }}
{{- if $ft.enabled }}
{{- if not $ft.redisAddress }}
{{- fail "gcsFaultTolerance.enabled=true needs gcsFaultTolerance.redisAddress: the host:port of the Redis the GCS persists its state to (e.g. redis.redis.svc.cluster.local:6379); set it, or set gcsFaultTolerance.enabled=false" }}
{{- end }}
{{- range $param := list "redis-password" "redis-username" }}
{{- if hasKey ($.Values.head.rayStartParams | default dict) $param }}
{{- fail (printf "head.rayStartParams.%s is set together with gcsFaultTolerance.enabled=true, which KubeRay rejects; remove it (the chart passes the Redis address and password from gcsFaultTolerance)" $param) }}
{{- end }}
{{- end }}
{{- range $e := $.Values.env | default list }}
{{- if has $e.name (list "RAY_REDIS_ADDRESS" "REDIS_PASSWORD" "REDIS_USERNAME") }}
{{- fail (printf "env sets %s together with gcsFaultTolerance.enabled=true, which KubeRay rejects; remove it (the chart passes the Redis address and password from gcsFaultTolerance)" $e.name) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The Ray Serve config: one application whose args are the kvtide config, the same document
`kvtide serve-config` prints (cluster/serve_config.py); a unit test pins the equality.
*/}}
{{- define "kvtide.serveConfig" -}}
{{- $args := .Values.kvtide }}
{{- if hasKey $args "ingress" }}
{{- /* kvtide.ingress is the old name of kvtide.frontend: the user's old keys win over the defaults. */}}
{{- $args = omit (deepCopy .Values.kvtide) "ingress" }}
{{- $_ := set $args "frontend" (mergeOverwrite (deepCopy (.Values.kvtide.frontend | default dict)) (deepCopy .Values.kvtide.ingress)) }}
{{- end }}
{{- $app := dict "name" "kvtide" "route_prefix" "/" "import_path" "kvtide.cluster.app:build_app" "args" $args }}
{{- $http := dict "host" "0.0.0.0" "port" (int (include "kvtide.httpPort" .)) }}
{{- /* proxyLocation is the one key not from the kvtide config; EveryNode is also serve-config's. */}}
{{- toYaml (dict "proxy_location" (.Values.proxyLocation | default "EveryNode") "http_options" $http "applications" (list $app)) }}
{{- end }}

{{/*
Env, mounts and volumes every Ray pod shares (the head's routing peer tokenizes, so it
needs the model files and the token too).
*/}}
{{- define "kvtide.rayEnv" -}}
- name: HF_HOME
  value: {{ .Values.modelCache.mountPath | quote }}
{{- if .Values.modelCache.compileCaches }}
{{- /* vLLM's torch.compile artifacts and Triton's kernels, kept where the weights are: a new
replica on a node (hostPath) or anywhere (pvc) then loads them instead of compiling them,
which is most of a cold engine's initialization. */}}
- name: VLLM_CACHE_ROOT
  value: {{ printf "%s/.vllm-cache" .Values.modelCache.mountPath | quote }}
- name: TRITON_CACHE_DIR
  value: {{ printf "%s/.triton-cache" .Values.modelCache.mountPath | quote }}
{{- end }}
{{- /* Process-level Serve settings every Ray container must agree on; the same names and
values as KvtideConfig.ray_process_env() (a unit test compares them). */}}
- name: RAY_SERVE_THROUGHPUT_OPTIMIZED
  value: {{ ternary "1" "0" (dig "http" "throughput_optimized" true .Values.kvtide) | quote }}
- name: RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S
  value: {{ dig "autoscaling" "metrics_push_interval_s" 2.0 .Values.kvtide | toString | quote }}
{{- $direct := eq (dig "http" "mode" "direct" .Values.kvtide) "direct" }}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: {{ ternary "1" "0" $direct | quote }}
{{- if $direct }}
{{- /* Direct mode: engine replicas serve HTTP behind Serve's HAProxy; the routing peer needs the body. */}}
- name: RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY
  value: "1"
- name: RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE
  value: {{ dig "http" "router_buffer_bytes" 262144 .Values.kvtide | int64 | toString | quote }}
- name: RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE
  value: {{ dig "http" "router_replicas_per_node" 1 .Values.kvtide | int64 | toString | quote }}
- name: RAY_SERVE_HAPROXY_RETRIES
  value: {{ add 3 (dig "ingress" "admission" "max_retries" (dig "frontend" "admission" "max_retries" 2 .Values.kvtide) .Values.kvtide | int64) | toString | quote }}
- name: RAY_SERVE_HAPROXY_RETRY_ON
  value: "conn-failure empty-response junk-response 500 503"
{{- end }}
- name: RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S
  value: "2"
- name: RAY_worker_niceness
  value: "0"
{{- if .Values.hfToken.secretName }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.hfToken.secretName }}
      key: {{ .Values.hfToken.secretKey }}
{{- end }}
{{- if .Values.apiKeys.existingSecret }}
{{- $envName := dig "ingress" "auth" "api_keys_env" (dig "frontend" "auth" "api_keys_env" "" .Values.kvtide) .Values.kvtide }}
{{- if not $envName }}
{{- fail "apiKeys.existingSecret is set but kvtide.frontend.auth.api_keys_env is empty; set it (default KVTIDE_API_KEYS) so the frontend reads the keys" }}
{{- end }}
- name: {{ $envName }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKeys.existingSecret }}
      key: {{ .Values.apiKeys.secretKey }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kvtide.rayVolumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
- name: model-cache
  mountPath: {{ .Values.modelCache.mountPath }}
{{- end }}

{{- define "kvtide.rayVolumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shm.sizeLimit }}
- name: model-cache
{{- if eq .Values.modelCache.type "pvc" }}
{{- if not .Values.modelCache.pvc.claimName }}
{{- fail "modelCache.pvc.claimName is empty: modelCache.type=pvc needs the name of an existing PersistentVolumeClaim" }}
{{- end }}
  persistentVolumeClaim:
    claimName: {{ .Values.modelCache.pvc.claimName }}
{{- else if eq .Values.modelCache.type "hostPath" }}
  hostPath:
    path: {{ .Values.modelCache.hostPath.path }}
    type: DirectoryOrCreate
{{- else }}
  emptyDir:
  {{- with .Values.modelCache.emptyDir.sizeLimit }}
    sizeLimit: {{ . }}
  {{- else }} {}
  {{- end }}
{{- end }}
{{- end }}

{{/* preStop: leave the Ray cluster cleanly so the GCS does not wait on a dead node. */}}
{{- define "kvtide.rayLifecycle" -}}
preStop:
  exec:
    command: ["/bin/sh", "-c", "ray stop"]
{{- end }}
