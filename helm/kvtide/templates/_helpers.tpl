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
enginesPerPod: {{ $enginesPerPod }}
minReplicas: {{ $min }}
maxReplicas: {{ $max }}
{{- end }}

{{/*
Host memory, in bytes, that the CPU KV tiers of one worker pod's engines take: engines per pod x
kvtide.engine.kv_offload.size_gib GiB; 0 without a tier. vLLM's native tier lives in a file in
/dev/shm (a memory-backed volume here), so it counts against the pod's memory and against the
/dev/shm volume's size limit alike: both grow by it. Call with (dict "root" $ "enginesPerPod" n).
*/}}
{{- define "kvtide.kvOffloadBytesPerPod" -}}
{{- $gib := dig "engine" "kv_offload" "size_gib" nil (.root.Values.kvtide | default dict) }}
{{- if kindIs "invalid" $gib }}0{{ else }}{{ mulf (int .enginesPerPod) (float64 $gib) 1073741824.0 }}{{ end }}
{{- end }}

{{/*
A Kubernetes quantity ("64Gi", "68719476736", "1.5e10", "100M", or a number) in bytes, as a float.
*/}}
{{- define "kvtide.quantityBytes" -}}
{{- $field := .field }}
{{- $value := .value }}
{{- if or (kindIs "float64" $value) (kindIs "int" $value) (kindIs "int64" $value) }}
{{- float64 $value }}
{{- else }}
{{- $q := toString $value | trim }}
{{- $number := regexFind "^([0-9]+[.]?[0-9]*|[.][0-9]+)" $q }}
{{- $suffix := trimPrefix $number $q }}
{{- $scales := dict "" 1.0 "m" 1e-3 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 }}
{{- if not $number }}
{{- fail (printf "%s=%s is not a Kubernetes quantity; write it like 64Gi" $field $q) }}
{{- else if hasKey $scales $suffix }}
{{- mulf (float64 $number) (get $scales $suffix) }}
{{- else if regexMatch "^[eE][+]?[0-9]+$" $suffix }}
{{- $bytes := float64 $number }}
{{- range until (int (trimPrefix "+" (substr 1 -1 $suffix))) }}{{ $bytes = mulf $bytes 10 }}{{ end }}
{{- $bytes }}
{{- else }}
{{- fail (printf "%s=%s is not a Kubernetes quantity; write it like 64Gi" $field $q) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A byte count as a memory quantity: whole GiB as Gi, else whole MiB as Mi, else bytes (rounded up).
*/}}
{{- define "kvtide.memoryQuantity" -}}
{{- $bytes := int64 (ceil (float64 .)) }}
{{- if eq (mod $bytes 1073741824) 0 }}{{ div $bytes 1073741824 }}Gi
{{- else if eq (mod $bytes 1048576) 0 }}{{ div $bytes 1048576 }}Mi
{{- else }}{{ $bytes }}{{ end }}
{{- end }}

{{/*
`quantity` plus `extraBytes` bytes, as a memory quantity; `quantity` unchanged when extraBytes is 0.
Call with (dict "field" "workerGroups[0].resources.requests.memory" "quantity" q "extraBytes" n).
*/}}
{{- define "kvtide.addMemory" -}}
{{- if eq (float64 .extraBytes) 0.0 }}
{{- .quantity }}
{{- else }}
{{- $bytes := include "kvtide.quantityBytes" (dict "field" .field "value" .quantity) | float64 }}
{{- include "kvtide.memoryQuantity" (addf $bytes (float64 .extraBytes)) }}
{{- end }}
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
{{- include "kvtide.validateAuth" . }}
{{- end }}

{{/*
kvtide.frontend.auth as the app will read it: kvtide.frontend.auth with the old name's
kvtide.ingress.auth over it (as in kvtide.serveConfig). YAML.
*/}}
{{- define "kvtide.frontendAuth" -}}
{{- $auth := deepCopy (dig "frontend" "auth" dict .Values.kvtide) }}
{{- toYaml (mergeOverwrite $auth (deepCopy (dig "ingress" "auth" dict .Values.kvtide))) }}
{{- end }}

{{/*
API keys are on by default: a release whose key Secret was forgotten must not serve an open
API, so rendering fails unless the Secret is given or require_keys is turned off explicitly.
*/}}
{{- define "kvtide.validateAuth" -}}
{{- $auth := include "kvtide.frontendAuth" . | fromYaml }}
{{- if and $auth.require_keys (not .Values.apiKeys.existingSecret) }}
{{- fail "API keys are required (kvtide.frontend.auth.require_keys=true) but apiKeys.existingSecret is empty. Create a Secret holding the key file (one `<key>` or `<tenant> <key>` per line), e.g. `kubectl create secret generic kvtide-api-keys --from-file=api-keys=./api-keys`, and set apiKeys.existingSecret=kvtide-api-keys; or, to serve WITHOUT keys (anyone who reaches the port is served), set kvtide.frontend.auth.require_keys=false explicitly" }}
{{- end }}
{{- if .Values.apiKeys.existingSecret }}
{{- if not .Values.apiKeys.secretKey }}
{{- fail "apiKeys.secretKey is empty: name the key of apiKeys.existingSecret that holds the key file (default api-keys)" }}
{{- end }}
{{- $file := include "kvtide.apiKeysFile" . }}
{{- with $auth.api_keys_file }}
{{- if ne . $file }}
{{- fail (printf "kvtide.frontend.auth.api_keys_file=%s is set together with apiKeys.existingSecret, which the chart mounts at %s; remove api_keys_file (the chart sets it) or apiKeys.existingSecret" . $file) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Where the Secrets are mounted on every Ray pod. kvtide reads the files; the values never
become env vars, which every process of the pod (and a crash dump) would see.
*/}}
{{- define "kvtide.apiKeysDir" -}}/etc/kvtide/api-keys{{- end }}
{{- define "kvtide.apiKeysFile" -}}
{{- printf "%s/%s" (include "kvtide.apiKeysDir" .) .Values.apiKeys.secretKey }}
{{- end }}
{{- define "kvtide.internalSecretDir" -}}/etc/kvtide/internal{{- end }}

{{- define "kvtide.internalSecretName" -}}
{{- .Values.internalSecret.existingSecret | default (printf "%s-internal" (include "kvtide.fullname" .)) }}
{{- end }}

{{- define "kvtide.rayAuthSecretName" -}}
{{- .Values.rayAuth.existingSecret | default (printf "%s-ray-auth" (include "kvtide.fullname" .)) }}
{{- end }}

{{/*
A random value for a chart-generated Secret, kept across upgrades: the one already in the
cluster when there is one (Helm `lookup`; empty under `helm template`), else a fresh one.
Call with (dict "root" $ "name" <Secret name> "key" <data key>). Base64, as Secret data.
*/}}
{{- define "kvtide.persistentRandom" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name }}
{{- $value := "" }}
{{- if $existing }}{{ $value = index ($existing.data | default dict) .key | default "" }}{{ end }}
{{- $value | default (randAlphaNum 64 | b64enc) }}
{{- end }}

{{/*
ServiceAccounts (templates/serviceaccount.yaml). The head has its own only while Ray's
autoscaler runs: KubeRay binds its autoscaler Role to the head pod's account.
*/}}
{{- define "kvtide.serviceAccountName" -}}
{{- include "kvtide.fullname" . }}
{{- end }}
{{- define "kvtide.headServiceAccountName" -}}
{{- printf "%s-head" (include "kvtide.fullname" .) }}
{{- end }}

{{/*
The head ServiceAccount's API token for the Ray autoscaler sidecar: what the kubelet's automount
would project (a short-lived, auto-rotated token, the cluster CA, the namespace), as a volume
that only the sidecar mounts, at the path the autoscaler reads
(/var/run/secrets/kubernetes.io/serviceaccount). Mode 0440, group fsGroup.
*/}}
{{- define "kvtide.apiTokenVolume" -}}
- name: kube-api-access
  projected:
    defaultMode: 288
    sources:
      - serviceAccountToken:
          path: token
          expirationSeconds: 3607
      - configMap:
          name: kube-root-ca.crt
          items:
            - {key: ca.crt, path: ca.crt}
      - downwardAPI:
          items:
            - path: namespace
              fieldRef: {apiVersion: v1, fieldPath: metadata.namespace}
{{- end }}

{{/*
Drain bounds, in whole seconds, from the frontend's deadline (kvtide.frontend.admission.
request_timeout_s, or the old kvtide.ingress name; null or unset: the model's 600):
  preStop `kvtide drain-node --timeout-s` = deadline + 10: every admitted request can finish
  terminationGracePeriodSeconds          = deadline + 30: the drain, then `ray stop`
*/}}
{{- define "kvtide.requestTimeoutSeconds" -}}
{{- $t := dig "ingress" "admission" "request_timeout_s" (dig "frontend" "admission" "request_timeout_s" 600 .Values.kvtide) .Values.kvtide }}
{{- int (ceil (float64 $t)) }}
{{- end }}
{{- define "kvtide.drainTimeoutSeconds" -}}
{{- add (int (include "kvtide.requestTimeoutSeconds" .)) 10 }}
{{- end }}
{{- define "kvtide.terminationGracePeriodSeconds" -}}
{{- add (int (include "kvtide.requestTimeoutSeconds" .)) 30 }}
{{- end }}

{{/*
Pod-level fields every Ray pod shares: its ServiceAccount, the restricted-profile
securityContext and the grace period the drain needs. Call with (dict "root" $ "head" bool).
No pod automounts an API token: the autoscaling head's token is projected into its autoscaler
sidecar alone (kvtide.apiTokenVolume), so Ray and kvtide processes never hold one.
*/}}
{{- define "kvtide.podSpecSecurity" -}}
{{- $root := .root }}
{{- $engines := include "kvtide.engineReplicas" $root | fromYaml }}
{{- $apiAccess := and .head $engines.autoscaling -}}
serviceAccountName: {{ ternary (include "kvtide.headServiceAccountName" $root) (include "kvtide.serviceAccountName" $root) $apiAccess }}
automountServiceAccountToken: false
terminationGracePeriodSeconds: {{ include "kvtide.terminationGracePeriodSeconds" $root }}
{{- with $root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
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
{{- $args := deepCopy .Values.kvtide }}
{{- if hasKey $args "ingress" }}
{{- /* kvtide.ingress is the old name of kvtide.frontend: the user's old keys win over the defaults. */}}
{{- $args = omit $args "ingress" }}
{{- $_ := set $args "frontend" (mergeOverwrite (deepCopy (.Values.kvtide.frontend | default dict)) (deepCopy .Values.kvtide.ingress)) }}
{{- end }}
{{- if .Values.apiKeys.existingSecret }}
{{- /* Keys come from the mounted Secret file only: api_keys_env null turns off the model's
default env var, so no other source can add a key. */}}
{{- $frontend := get $args "frontend" | default dict }}
{{- $auth := get $frontend "auth" | default dict }}
{{- $_ := set $auth "api_keys_file" (include "kvtide.apiKeysFile" .) }}
{{- $_ := set $auth "api_keys_env" nil }}
{{- $_ := set $frontend "auth" $auth }}
{{- $_ := set $args "frontend" $frontend }}
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
  value: "conn-failure empty-response junk-response 503"
{{- /* At least the longest a request may last (its deadline; null: the drain a stopping replica gets,
DRAIN_TIMEOUT_WITHOUT_DEADLINE_S) plus HAProxy's own time before it (HAPROXY_HARD_STOP_MARGIN_S; both in
config/model.py): an old HAProxy after a reload keeps its streams that long. */}}
{{- $timeout := dig "ingress" "admission" "request_timeout_s" (dig "frontend" "admission" "request_timeout_s" 600 .Values.kvtide) .Values.kvtide | default 600 }}
- name: RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S
  value: {{ add (ceil $timeout | int64) 60 | toString | quote }}
- name: KVTIDE_HAPROXY_HEADER_TIMEOUT_S
  value: {{ dig "http" "header_timeout_s" 10 .Values.kvtide | int64 | toString | quote }}
{{- /* kvtide's HAProxy (cluster/haproxy_shim.py): Ray's config with kvtide's rules added, then Ray's
binary. Not in ray_process_env: the path is the image's (the Dockerfile checks it is there). */}}
- name: RAY_SERVE_HAPROXY_BINARY_PATH
  value: {{ include "kvtide.haproxyShimPath" . | quote }}
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
{{- /* The cluster's internal secret (deployments/internal_auth.py), as a file: the routing
peer refuses to start without it, and replicas trust only routing headers signed with it. */}}
- name: KVTIDE_INTERNAL_SECRET_FILE
  value: {{ printf "%s/secret" (include "kvtide.internalSecretDir" .) | quote }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Mounts of every Ray container. With a read-only root filesystem these are the only places
Ray, HAProxy and vLLM can write; values.yaml (securityContext) lists what goes where.
*/}}
{{- define "kvtide.rayVolumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
- name: model-cache
  mountPath: {{ .Values.modelCache.mountPath }}
- name: tmp
  mountPath: /tmp
{{- range $dir := list "cache" "config" "triton" "nv" }}
- name: home
  mountPath: {{ printf "%s/.%s" ($.Values.homeDir | trimSuffix "/") $dir }}
  subPath: {{ $dir }}
{{- end }}
{{- if .Values.apiKeys.existingSecret }}
- name: api-keys
  mountPath: {{ include "kvtide.apiKeysDir" . }}
  readOnly: true
{{- end }}
- name: internal-secret
  mountPath: {{ include "kvtide.internalSecretDir" . }}
  readOnly: true
{{- end }}

{{/*
Volumes of every Ray pod. Call with (dict "root" $ "shmSizeLimit" q): q is the /dev/shm volume's
size limit, shm.sizeLimit unless given (a worker pod's grows by its engines' CPU KV tiers).
*/}}
{{- define "kvtide.rayVolumes" -}}
{{- $root := .root }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSizeLimit | default $root.Values.shm.sizeLimit }}
- name: tmp
  emptyDir: {}
- name: home
  emptyDir: {}
{{- /* The Secrets: only the named key, owner root, group fsGroup, mode 0440 (288); a missing
key keeps the pod from starting instead of starting it without keys. */}}
{{- if $root.Values.apiKeys.existingSecret }}
- name: api-keys
  secret:
    secretName: {{ $root.Values.apiKeys.existingSecret }}
    defaultMode: 288
    items:
      - {key: {{ $root.Values.apiKeys.secretKey | quote }}, path: {{ $root.Values.apiKeys.secretKey | quote }}}
{{- end }}
- name: internal-secret
  secret:
    secretName: {{ include "kvtide.internalSecretName" $root }}
    defaultMode: 288
    items:
      - {key: secret, path: secret}
- name: model-cache
{{- if eq $root.Values.modelCache.type "pvc" }}
{{- if not $root.Values.modelCache.pvc.claimName }}
{{- fail "modelCache.pvc.claimName is empty: modelCache.type=pvc needs the name of an existing PersistentVolumeClaim" }}
{{- end }}
  persistentVolumeClaim:
    claimName: {{ $root.Values.modelCache.pvc.claimName }}
{{- else if eq $root.Values.modelCache.type "hostPath" }}
  hostPath:
    path: {{ $root.Values.modelCache.hostPath.path }}
    type: DirectoryOrCreate
{{- else }}
  emptyDir:
  {{- with $root.Values.modelCache.emptyDir.sizeLimit }}
    sizeLimit: {{ . }}
  {{- else }} {}
  {{- end }}
{{- end }}
{{- end }}

{{/*
preStop: `kvtide drain-node` asks Ray to drain this node (Serve moves its replicas off, the
proxy stops taking connections) and waits for the requests in flight, at most the frontend's
deadline + 10 s; then `ray stop` leaves the cluster cleanly so the GCS does not wait on a dead
node. `;`, not `&&`: a failed drain must still stop Ray. terminationGracePeriodSeconds
(kvtide.podSpecSecurity) leaves room for both.
*/}}
{{- define "kvtide.rayLifecycle" -}}
preStop:
  exec:
    command: ["/bin/sh", "-c", "kvtide drain-node --timeout-s {{ include "kvtide.drainTimeoutSeconds" . }} ; ray stop"]
{{- end }}

{{/*
Where the image installs kvtide's HAProxy command (the Ray image's Python environment; the Dockerfile checks it).
*/}}
{{- define "kvtide.haproxyShimPath" -}}
/home/ray/anaconda3/bin/kvtide-haproxy
{{- end }}
