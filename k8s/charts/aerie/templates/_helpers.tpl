{{/*
Names, labels and the pieces every aerie pod shares. Templates call the component helpers with
(dict "ctx" $ "component" "drafter").
*/}}

{{- define "aerie.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "aerie.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<component>", e.g. aerie-drafter. */}}
{{- define "aerie.componentName" -}}
{{- printf "%s-%s" (include "aerie.fullname" .ctx | trunc 50 | trimSuffix "-") .component }}
{{- end }}

{{- define "aerie.selectorLabels" -}}
app.kubernetes.io/name: {{ include "aerie.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "aerie.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 }}
{{ include "aerie.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: aerie
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "aerie.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "aerie.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The aerie image of a pod, for (dict "ctx" $ "gpu" true|false): image.tag as set, else the
appVersion, plus image.gpuTagSuffix (the CUDA build) on a pod that runs on a GPU. */}}
{{- define "aerie.image" -}}
{{- $i := .ctx.Values.image }}
{{- $tag := $i.tag | toString }}
{{- if not $tag }}
{{- $tag = printf "%s%s" .ctx.Chart.AppVersion (ternary $i.gpuTagSuffix "" (.gpu | default false)) }}
{{- end }}
{{- printf "%s:%s" $i.repository $tag }}
{{- end }}

{{/* In-cluster DNS name of a component's Service. */}}
{{- define "aerie.serviceHost" -}}
{{- printf "%s.%s.svc" (include "aerie.componentName" .) .ctx.Release.Namespace }}
{{- end }}

{{/*
Redis: the Secret holding the password ("" when there is none), its key, and the URL the coordinator
gets as AERIE_REDIS_URL. The URL holds no password: the coordinator gets it as AERIE_REDIS_PASSWORD
from the Secret and hands it to the Redis client separately, so it never appears in a rendered
manifest and needs no URL-encoding (the kubelet would expand $(VAR) into a URL verbatim).
*/}}
{{- define "aerie.redis.secretName" -}}
{{- if .Values.redis.enabled }}
{{- default (include "aerie.componentName" (dict "ctx" . "component" "redis")) .Values.redis.auth.existingSecret }}
{{- else }}
{{- .Values.externalRedis.existingSecret }}
{{- end }}
{{- end }}

{{- define "aerie.redis.secretKey" -}}
{{- if .Values.redis.enabled }}
{{- .Values.redis.auth.existingSecretPasswordKey }}
{{- else }}
{{- .Values.externalRedis.existingSecretPasswordKey }}
{{- end }}
{{- end }}

{{- define "aerie.redis.url" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s:%d/%d" (include "aerie.serviceHost" (dict "ctx" . "component" "redis")) (int .Values.redis.port) (int .Values.redis.db) }}
{{- else }}
{{- $url := required "externalRedis.url is required when redis.enabled is false" .Values.externalRedis.url }}
{{- if not (regexMatch "^rediss?://[^/@]+(/[0-9]*)?$" $url) }}
{{- fail (printf "externalRedis.url must look like redis://host:port/db or rediss://... without credentials (the password comes from externalRedis.existingSecret); got %q" $url) }}
{{- end }}
{{- if .Values.externalRedis.username }}
{{- regexReplaceAll "^(rediss?://)" $url (printf "${1}%s@" .Values.externalRedis.username) }}
{{- else }}
{{- $url }}
{{- end }}
{{- end }}
{{- end }}

{{/* A model path value: Hub ids (model.source hub), absolute paths and "none"/"auto" as given, others
under model.mountPath. */}}
{{- define "aerie.modelPath" -}}
{{- $p := .path }}
{{- if or (eq .ctx.Values.model.source "hub") (hasPrefix "/" $p) (has $p (list "none" "auto")) }}
{{- $p }}
{{- else }}
{{- printf "%s/%s" (trimSuffix "/" .ctx.Values.model.mountPath) $p }}
{{- end }}
{{- end }}

{{/* ConfigMap data every service shares. */}}
{{- define "aerie.commonConfig" -}}
AERIE_HOST: {{ .ctx.Values.config.host | quote }}
AERIE_LOG_LEVEL: {{ .ctx.Values.config.logLevel | quote }}
AERIE_METRICS_PORT: {{ .ctx.Values.config.metricsPort | int64 | quote }}
AERIE_MAX_MESSAGE_BYTES: {{ .ctx.Values.config.maxMessageBytes | int64 | quote }}
AERIE_DRAIN_S: {{ .ctx.Values.config.drainSeconds | toString | quote }}
AERIE_CACHE_DIR: {{ .ctx.Values.config.cacheDir | quote }}
XDG_CACHE_HOME: {{ .ctx.Values.config.cacheDir | quote }}
HF_HOME: {{ printf "%s/huggingface" .ctx.Values.config.cacheDir | quote }}
HF_HUB_OFFLINE: "1"
TRANSFORMERS_OFFLINE: "1"
TORCHINDUCTOR_CACHE_DIR: {{ printf "%s/inductor" .ctx.Values.config.cacheDir | quote }}
TRITON_CACHE_DIR: {{ printf "%s/triton" .ctx.Values.config.cacheDir | quote }}
HOME: "/tmp"
OTEL_SERVICE_NAME: {{ printf "aerie-%s" .component | quote }}
{{- with .ctx.Values.otel.endpoint }}
OTEL_EXPORTER_OTLP_ENDPOINT: {{ . | quote }}
{{- end }}
{{- end }}

{{/* ConfigMap data for the model settings of drafters and verifiers. */}}
{{- define "aerie.modelConfig" -}}
AERIE_DTYPE: {{ .ctx.Values.model.dtype | quote }}
{{- with .ctx.Values.model.target }}
AERIE_TARGET: {{ include "aerie.modelPath" (dict "ctx" $.ctx "path" .) | quote }}
{{- end }}
{{- include "aerie.downloadDirConfig" .ctx }}
{{- end }}

{{/* AERIE_DOWNLOAD_DIR (model.source hub): the Hugging Face cache on the model PVC, where Hub ids are
read from (HF_HUB_OFFLINE=1: never downloaded by aerie's containers). */}}
{{- define "aerie.downloadDirConfig" -}}
{{- if eq .Values.model.source "hub" }}
AERIE_DOWNLOAD_DIR: {{ .Values.model.mountPath | quote }}
{{- end }}
{{- end }}

{{/* model.source hub: the Hub ids are checked and the PVC named ("" otherwise). */}}
{{- define "aerie.hubClaimName" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "hub" }}
{{- $id := "^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+(@[A-Za-z0-9_./-]+)?(/[A-Za-z0-9_.-]+[.]gguf)?$" }}
{{- if not (regexMatch $id ($m.target | toString)) }}
{{- fail (printf "model.target must be a Hugging Face Hub id ORG/NAME[@REVISION][/FILE.gguf] with model.source hub; got %q" ($m.target | toString)) }}
{{- end }}
{{- if and .Values.drafter.enabled (not (regexMatch $id ($m.draft | toString))) }}
{{- fail (printf "model.draft must be the Hub id of an EAGLE head for the target (e.g. yuhuili/EAGLE-LLaMA3.1-Instruct-8B) with model.source hub and drafter.enabled; got %q" ($m.draft | toString)) }}
{{- end }}
{{- default (include "aerie.componentName" (dict "ctx" . "component" "models")) $m.hub.existingClaim }}
{{- end }}
{{- end }}

{{- define "aerie.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.fsGroup }}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "aerie.containerSecurityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Pod-template annotations: roll pods when their ConfigMap changes. Also checks that the
termination grace outlasts the drain. */}}
{{- define "aerie.podAnnotations" -}}
{{- $grace := (index .ctx.Values .component).terminationGracePeriodSeconds }}
{{- if le (float64 $grace) (float64 .ctx.Values.config.drainSeconds) }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%v) must exceed config.drainSeconds (%v)" .component $grace .ctx.Values.config.drainSeconds) }}
{{- end -}}
{{- if eq .component "coordinator" }}
{{- /* SIGTERM: AERIE_DRAIN_S for sequences to finish, then up to one round (at most 30 s or the RPC
deadline) before the rest are handed over */}}
{{- $handover := min 30 (int .ctx.Values.coordinator.rpcTimeoutSeconds) }}
{{- if le (float64 $grace) (addf .ctx.Values.config.drainSeconds $handover) }}
{{- fail (printf "coordinator.terminationGracePeriodSeconds (%v) must exceed config.drainSeconds + min(30, coordinator.rpcTimeoutSeconds) (%v): a draining coordinator hands its sequences over after the drain and one round" $grace (addf .ctx.Values.config.drainSeconds $handover)) }}
{{- end -}}
{{- end -}}
checksum/config: {{ include (print .ctx.Template.BasePath "/configmap.yaml") .ctx | sha256sum }}
{{- with (index .ctx.Values .component).podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Environment every aerie container gets besides its ConfigMap: pod identity for traces. */}}
{{- define "aerie.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)"
{{- end }}

{{/* The port the probes ask: the gRPC port, or with security.tls.enabled the plaintext health-only
port (AERIE_HEALTH_PORT = probes.healthPort: kubelet gRPC probes cannot speak TLS; that port serves the
gRPC health service and nothing else, with the same statuses as the TLS port). */}}
{{- define "aerie.probePort" -}}
{{- if .ctx.Values.security.tls.enabled }}{{ .ctx.Values.probes.healthPort }}{{ else }}{{ .port }}{{ end }}
{{- end }}

{{/* Registration (coordinator.discoverRegistered "1"): the heartbeat settings of a drafter or
verifier ConfigMap. */}}
{{- define "aerie.registrationConfig" -}}
{{- if eq (.ctx.Values.coordinator.discoverRegistered | toString) "1" }}
AERIE_HEARTBEAT_S: {{ .ctx.Values.registration.heartbeatSeconds | toString | quote }}
AERIE_HEARTBEAT_TTL_S: {{ .ctx.Values.registration.heartbeatTtlSeconds | toString | quote }}
{{- end }}
{{- end }}

{{/* Registration env of a drafter or verifier container: the Redis URL (no credentials; the password
as AERIE_REDIS_PASSWORD from the Secret) and the address it advertises, its pod IP from the downward
API. Empty while coordinator.discoverRegistered is "0". */}}
{{- define "aerie.registrationEnv" -}}
{{- if eq (.ctx.Values.coordinator.discoverRegistered | toString) "1" }}
{{- $redisSecret := include "aerie.redis.secretName" .ctx }}
{{- if $redisSecret }}
- name: AERIE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $redisSecret }}
      key: {{ include "aerie.redis.secretKey" .ctx }}
{{- end }}
- name: AERIE_REDIS_URL
  value: {{ include "aerie.redis.url" .ctx | quote }}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: AERIE_ADVERTISE_ADDRESS
  value: {{ printf "$(POD_IP):%d" (int .port) | quote }}
{{- end }}
{{- end }}

{{/* gRPC startup, readiness and liveness probes of a drafter or verifier on a port (the standard gRPC
health service ""). */}}
{{- define "aerie.grpcProbes" -}}
{{- $p := .ctx.Values.probes -}}
startupProbe:
  {{- include "aerie.grpcProbeAction" (dict "ctx" .ctx "port" (include "aerie.probePort" .)) | nindent 2 }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
readinessProbe:
  {{- include "aerie.grpcProbeAction" (dict "ctx" .ctx "port" (include "aerie.probePort" .) "timeout" $p.readiness.timeoutSeconds) | nindent 2 }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
livenessProbe:
  {{- include "aerie.grpcProbeAction" (dict "ctx" .ctx "port" (include "aerie.probePort" .) "service" .liveness "timeout" $p.liveness.timeoutSeconds) | nindent 2 }}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
{{- end }}

{{/* The coordinator's probes: startup asks the HTTP API (GET /metrics: no token, no downstream call;
the HTTP server starts after gRPC, so both listen once it passes), readiness the gRPC health "" or, with
probes.coordinatorReadiness http, vLLM's GET /health (200 only while a verifier answers), liveness the
gRPC health name "liveness" (SERVING while Redis is down: a restart would not bring Redis back). */}}
{{- define "aerie.coordinatorProbes" -}}
{{- $p := .ctx.Values.probes -}}
{{- $scheme := ternary "HTTPS" "HTTP" .ctx.Values.security.tls.enabled -}}
{{- if not (has $p.coordinatorReadiness (list "grpc" "http")) }}
{{- fail (printf "probes.coordinatorReadiness must be grpc or http; got %v" $p.coordinatorReadiness) }}
{{- end -}}
startupProbe:
  httpGet:
    path: /metrics
    port: http
    scheme: {{ $scheme }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
readinessProbe:
  {{- if eq $p.coordinatorReadiness "http" }}
  httpGet:
    path: /health
    port: http
    scheme: {{ $scheme }}
  {{- else }}
  {{- include "aerie.grpcProbeAction" (dict "ctx" .ctx "port" (include "aerie.probePort" .) "timeout" $p.readiness.timeoutSeconds) | nindent 2 }}
  {{- end }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
livenessProbe:
  {{- include "aerie.grpcProbeAction" (dict "ctx" .ctx "port" (include "aerie.probePort" .) "service" "liveness" "timeout" $p.liveness.timeoutSeconds) | nindent 2 }}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
{{- end }}

{{/* "true" when the drafter runs as a process in every verifier container (drafter.placement verifier). */}}
{{- define "aerie.drafterInVerifier" -}}
{{- $d := .Values.drafter }}
{{- if not (has $d.placement (list "pool" "verifier" "colocated")) }}
{{- fail (printf "drafter.placement must be pool, verifier or colocated; got %v" $d.placement) }}
{{- end }}
{{- if and $d.enabled (eq $d.placement "verifier") }}true{{ end }}
{{- end }}

{{/* "true" when every verifier process serves the head too (drafter.placement colocated: `aerie verifier
--draft`, AERIE_VERIFIER_DRAFT): the verifiers are the drafter pool, at their own addresses. */}}
{{- define "aerie.drafterColocated" -}}
{{- $d := .Values.drafter }}
{{- if and $d.enabled (eq $d.placement "colocated") }}
{{- if gt (int .Values.verifier.tpSize) 1 }}{{ fail "drafter.placement colocated needs verifier.tpSize 1 (a tensor-parallel group serves the target alone)" }}{{ end }}
true
{{- end }}
{{- end }}

{{/*
The verifier container's command with drafter.placement verifier: bash starts `aerie drafter` (its
settings that the verifier shares a name with given on its own command line through env) and `aerie
verifier`, waits for the first to exit, stops the other and exits with the first one's status, so the
kubelet restarts the container (both processes) when either dies. SIGTERM reaches both (each drains).
$(POD_IP) is expanded by the kubelet.
*/}}
{{- define "aerie.verifierWithDrafter" -}}
{{- $v := .Values -}}
drafter= verifier=
stop() { kill -TERM $drafter $verifier 2>/dev/null; }
trap stop TERM INT
env AERIE_MAX_SEQUENCES={{ $v.drafter.maxSequences | int64 }} \
    AERIE_IDLE_TTL_S={{ $v.drafter.idleTtlSeconds }} \
    AERIE_METRICS_PORT={{ $v.drafter.inVerifier.metricsPort | int64 }} \
    {{- if $v.security.tls.enabled }}
    AERIE_HEALTH_PORT={{ $v.drafter.inVerifier.healthPort | int64 }} \
    {{- end }}
    {{- if eq ($v.coordinator.discoverRegistered | toString) "1" }}
    AERIE_ADVERTISE_ADDRESS=$(POD_IP):{{ $v.drafter.port | int64 }} \
    {{- end }}
    OTEL_SERVICE_NAME=aerie-drafter \
    aerie drafter &
drafter=$!
aerie verifier &
verifier=$!
wait -n $drafter $verifier
status=$?
stop
wait
exit $status
{{- end }}

{{/* The action of one gRPC health probe: a native `grpc:` probe on Kubernetes 1.24+ (on by default
there, GA in 1.27); on older API servers, which drop the unknown `grpc` field, an `exec` probe running
the same standard health Check with the image's Python (grpcio-health-checking) on 127.0.0.1. */}}
{{- define "aerie.grpcProbeAction" -}}
{{- if semverCompare ">=1.24.0-0" .ctx.Capabilities.KubeVersion.Version -}}
grpc:
  port: {{ .port }}
  {{- with .service }}
  service: {{ . | quote }}
  {{- end }}
{{- else -}}
exec:
  command:
    - python
    - -c
    - >-
      import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g;
      r = g.HealthStub(grpc.insecure_channel("127.0.0.1:{{ .port }}")).Check(
      h.HealthCheckRequest(service={{ default "" .service | quote }}), timeout={{ default 10 .timeout }});
      sys.exit(r.status != h.HealthCheckResponse.SERVING)
{{- end }}
{{- end }}

{{/* Ports of an aerie container: gRPC and metrics. */}}
{{- define "aerie.containerPorts" -}}
- name: grpc
  containerPort: {{ .port }}
  protocol: TCP
- name: metrics
  containerPort: {{ .ctx.Values.config.metricsPort }}
  protocol: TCP
{{- if .ctx.Values.security.tls.enabled }}
- name: health
  containerPort: {{ .ctx.Values.probes.healthPort }}
  protocol: TCP
{{- end }}
{{- end }}

{{/* Writable scratch mounts (the root filesystem is read-only). */}}
{{- define "aerie.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: {{ .Values.config.cacheDir }}
{{- end }}

{{- define "aerie.scratchVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.config.tmpSizeLimit }}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.config.cacheSizeLimit }}
{{- end }}

{{/* The model volume of drafter and verifier pods (none when the model is baked into the image). */}}
{{- define "aerie.modelVolume" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: models
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "emptyDir" }}
- name: models
  emptyDir:
    sizeLimit: {{ $m.emptyDir.sizeLimit }}
{{- else if eq $m.source "hub" }}
# The Hugging Face cache: written by the fetch-model init container, mounted read-only in aerie's.
- name: models
  persistentVolumeClaim:
    claimName: {{ include "aerie.hubClaimName" . }}
{{- else if ne $m.source "image" }}
{{- fail (printf "model.source must be one of image, hub, pvc, hostPath, emptyDir; got %q" $m.source) }}
{{- end }}
{{- end }}

{{- define "aerie.modelMount" -}}
{{- if ne .Values.model.source "image" }}
- name: models
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/*
Init containers that fill the model volume; they run before aerie in drafter and verifier pods, for
(dict "ctx" $ "heads" true|false "gpu" <the pod's image is the CUDA build>): with model.source hub first "fetch-model", which downloads the
target (and with heads the draft head) into the Hugging Face cache on the model PVC with aerie's own
resolver (services/model/hub.py: only the files aerie loads; a model already cached is not fetched
again; concurrent pods share huggingface_hub's file locks). Then model.initContainers: one without a
securityContext gets the restricted one, one without volumeMounts gets the model volume.
*/}}
{{- define "aerie.modelInitContainers" -}}
{{- $ := .ctx }}
{{- $m := $.Values.model }}
{{- if eq $m.source "hub" }}
- name: fetch-model
  image: {{ include "aerie.image" (dict "ctx" $ "gpu" .gpu) }}
  imagePullPolicy: {{ $.Values.image.pullPolicy }}
  command:
    - python
    - -c
    - |
      import sys
      from services.errors import AerieError
      from services.model.hub import resolve_model
      try:
          print("target", resolve_model(sys.argv[1]), flush=True)
          for head in sys.argv[2:]:
              print("draft head", resolve_model(head, "draft head"), flush=True)
      except AerieError as e:
          sys.exit(f"fetch-model: {e}")
  args:
    - {{ $m.target | quote }}
    {{- if and .heads $m.draft }}
    - {{ $m.draft | quote }}
    {{- end }}
  env:
    - name: AERIE_DOWNLOAD_DIR
      value: {{ $m.mountPath | quote }}
    # The image sets HF_HUB_OFFLINE=1 for aerie's services; this container is the one that downloads.
    - name: HF_HUB_OFFLINE
      value: "0"
    - name: HF_HOME
      value: /tmp/huggingface
    - name: HOME
      value: /tmp
    {{- with $m.hub.tokenSecret }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $m.hub.tokenSecretKey }}
    {{- end }}
  securityContext:
    {{- include "aerie.containerSecurityContext" $ | nindent 4 }}
  resources:
    {{- toYaml $m.hub.resources | nindent 4 }}
  volumeMounts:
    - name: models
      mountPath: {{ $m.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- range $m.initContainers }}
- {{ toYaml (omit . "securityContext" "volumeMounts") | nindent 2 | trim }}
  securityContext:
    {{- if .securityContext }}
    {{- toYaml .securityContext | nindent 4 }}
    {{- else }}
    {{- include "aerie.containerSecurityContext" $ | nindent 4 }}
    {{- end }}
  {{- if .volumeMounts }}
  volumeMounts:
    {{- toYaml .volumeMounts | nindent 4 }}
  {{- else if ne $.Values.model.source "image" }}
  volumeMounts:
    - name: models
      mountPath: {{ $.Values.model.mountPath }}
  {{- end }}
{{- end }}
{{- end }}

{{/* GPU resources merged into a container's resources. */}}
{{- define "aerie.resources" -}}
{{- $res := deepCopy (default dict .resources) }}
{{- if gt (int .gpus) 0 }}
{{- $gpu := dict .ctx.Values.gpuResourceName (int .gpus) }}
{{- $_ := set $res "limits" (merge (default dict (get $res "limits")) $gpu) }}
{{- $_ := set $res "requests" (merge (default dict (get $res "requests")) $gpu) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/*
The autoscaler of a component's workload, for (dict "ctx" $ "component" name "kind" Deployment|StatefulSet):
an autoscaling/v2 HorizontalPodAutoscaler (autoscaling.engine hpa) or a KEDA ScaledObject (keda), on the
coordinators' aerie:num_requests_waiting (<pool>.autoscaling.targetRequestsWaiting per pod) and/or CPU
utilisation (targetCPUUtilizationPercentage). Each refuses to render without its API in the cluster.
*/}}
{{- define "aerie.autoscaler" -}}
{{- $ctx := .ctx }}
{{- $a := (index $ctx.Values .component).autoscaling }}
{{- $g := $ctx.Values.autoscaling }}
{{- $waiting := $a.targetRequestsWaiting | default 0 }}
{{- $cpu := $a.targetCPUUtilizationPercentage | default 0 }}
{{- $coordinator := include "aerie.componentName" (dict "ctx" $ctx "component" "coordinator") }}
{{- if not (or $waiting $cpu $a.metrics) }}
{{- fail (printf "%s.autoscaling.enabled needs a signal: targetRequestsWaiting, targetCPUUtilizationPercentage or metrics" .component) }}
{{- end }}
{{- if eq $g.engine "hpa" }}
{{- if and $waiting (not ($ctx.Capabilities.APIVersions.Has "external.metrics.k8s.io/v1beta1")) }}
{{- fail (printf "%s.autoscaling.targetRequestsWaiting with autoscaling.engine hpa needs the external metrics API (external.metrics.k8s.io/v1beta1, e.g. prometheus-adapter with the rule in docs/kubernetes.md); install it (helm template: --api-versions external.metrics.k8s.io/v1beta1) or set autoscaling.engine keda" .component) }}
{{- end }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "aerie.componentName" . }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "aerie.labels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: {{ .kind }}
    name: {{ include "aerie.componentName" . }}
  minReplicas: {{ $a.minReplicas }}
  maxReplicas: {{ $a.maxReplicas }}
  metrics:
    {{- if $waiting }}
    # The coordinators' aerie:num_requests_waiting summed over this release, per pod of this pool.
    - type: External
      external:
        metric:
          name: {{ $g.externalMetricName }}
          selector:
            matchLabels:
              namespace: {{ $ctx.Release.Namespace }}
              service: {{ $coordinator }}
        target:
          type: AverageValue
          averageValue: {{ $waiting | toString | quote }}
    {{- end }}
    {{- if $cpu }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $cpu }}
    {{- end }}
    {{- with $a.metrics }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $a.scaleDownSeconds }}
  behavior:
    scaleDown:
      stabilizationWindowSeconds: {{ . }}
  {{- end }}
{{- else if eq $g.engine "keda" }}
{{- if not ($ctx.Capabilities.APIVersions.Has "keda.sh/v1alpha1/ScaledObject") }}
{{- fail "autoscaling.engine keda needs KEDA's ScaledObject CRD (keda.sh/v1alpha1) in the cluster; install KEDA (helm template: --api-versions keda.sh/v1alpha1/ScaledObject) or set autoscaling.engine hpa" }}
{{- end }}
{{- if $a.metrics }}
{{- fail (printf "%s.autoscaling.metrics are autoscaling/v2 metric specs (autoscaling.engine hpa); with keda use autoscaling.query" .component) }}
{{- end }}
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: {{ include "aerie.componentName" . }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "aerie.labels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: {{ .kind }}
    name: {{ include "aerie.componentName" . }}
  minReplicaCount: {{ $a.minReplicas }}
  maxReplicaCount: {{ $a.maxReplicas }}
  {{- with $a.scaleDownSeconds }}
  advanced:
    horizontalPodAutoscalerConfig:
      behavior:
        scaleDown:
          stabilizationWindowSeconds: {{ . }}
  {{- end }}
  triggers:
    {{- if $waiting }}
    - type: prometheus
      metricType: AverageValue
      metadata:
        serverAddress: {{ required "autoscaling.prometheusAddress is required with autoscaling.engine keda (the Prometheus KEDA queries)" $g.prometheusAddress | quote }}
        query: {{ default (printf "sum(aerie:num_requests_waiting{namespace=%q,service=%q})" $ctx.Release.Namespace $coordinator) $g.query | quote }}
        threshold: {{ $waiting | toString | quote }}
    {{- end }}
    {{- if $cpu }}
    - type: cpu
      metricType: Utilization
      metadata:
        value: {{ $cpu | toString | quote }}
    {{- end }}
{{- else }}
{{- fail (printf "autoscaling.engine must be hpa or keda; got %v" $g.engine) }}
{{- end }}
{{- end }}

{{/* PodDisruptionBudget for a component: policy/v1, or policy/v1beta1 on API servers without it
(before 1.21). */}}
{{- define "aerie.pdb" -}}
{{- $p := (index .ctx.Values .component).pdb }}
apiVersion: {{ if or (.ctx.Capabilities.APIVersions.Has "policy/v1") (not (.ctx.Capabilities.APIVersions.Has "policy/v1beta1")) }}policy/v1{{ else }}policy/v1beta1{{ end }}
kind: PodDisruptionBudget
metadata:
  name: {{ include "aerie.componentName" . }}
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "aerie.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ $p.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "aerie.selectorLabels" . | nindent 6 }}
{{- end }}

{{/* Security Secrets (templates/security.yaml): the TLS pair + CA, the internal token, the API tokens. */}}
{{- define "aerie.tlsSecretName" -}}
{{- default (include "aerie.componentName" (dict "ctx" . "component" "tls")) .Values.security.tls.existingSecret }}
{{- end }}

{{- define "aerie.internalTokenSecretName" -}}
{{- default (include "aerie.componentName" (dict "ctx" . "component" "internal-token")) .Values.security.internalToken.existingSecret }}
{{- end }}

{{- define "aerie.apiTokensSecretName" -}}
{{- default (include "aerie.componentName" (dict "ctx" . "component" "api-tokens")) .Values.security.apiTokens.existingSecret }}
{{- end }}

{{/* Environment of the trust boundaries (docs/security.md), for (dict "ctx" $ "component" name). */}}
{{- define "aerie.securityEnv" -}}
{{- $s := .ctx.Values.security }}
{{- $gateway := eq .component "gateway" }}
{{- if $s.tls.enabled }}
- name: AERIE_TLS_CERT
  value: /etc/aerie/tls/tls.crt
- name: AERIE_TLS_KEY
  value: /etc/aerie/tls/tls.key
- name: AERIE_TLS_CA
  value: /etc/aerie/tls/ca.crt
- name: AERIE_TLS_SERVER_NAME
  value: {{ $s.tls.serverName | quote }}
{{- if not $gateway }}
- name: AERIE_HEALTH_PORT
  value: {{ .ctx.Values.probes.healthPort | int64 | quote }}
{{- end }}
{{- end }}
{{- if and $s.internalToken.enabled (not $gateway) }}
- name: AERIE_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "aerie.internalTokenSecretName" .ctx }}
      key: token
{{- end }}
{{- if and (has .component (list "coordinator" "gateway")) $s.apiTokens.enabled }}
- name: AERIE_API_TOKENS_FILE
  value: /etc/aerie/api/tokens
{{- end }}
{{- if and $gateway $s.apiTokens.enabled }}
# the gateway's own calls (GetInfo for /health and the model name): the token of identity "gateway"
- name: AERIE_API_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "aerie.apiTokensSecretName" .ctx }}
      key: gateway
{{- end }}
{{- end }}

{{- define "aerie.securityMounts" -}}
{{- if .ctx.Values.security.tls.enabled }}
- name: tls
  mountPath: /etc/aerie/tls
  readOnly: true
{{- end }}
{{- if and (has .component (list "coordinator" "gateway")) .ctx.Values.security.apiTokens.enabled }}
- name: api-tokens
  mountPath: /etc/aerie/api
  readOnly: true
{{- end }}
{{- end }}

{{- define "aerie.securityVolumes" -}}
{{- if .ctx.Values.security.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "aerie.tlsSecretName" .ctx }}
    defaultMode: 0440
{{- end }}
{{- if and (has .component (list "coordinator" "gateway")) .ctx.Values.security.apiTokens.enabled }}
- name: api-tokens
  secret:
    secretName: {{ include "aerie.apiTokensSecretName" .ctx }}
    defaultMode: 0440
{{- end }}
{{- end }}
