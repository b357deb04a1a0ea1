#!/usr/bin/env bash
# End-to-end test of the Helm chart on a real one-node Kubernetes 1.20 cluster built from Debian
# bookworm's source package, with pods through Debian's docker.io (dockershim). docs/kubernetes.md,
# "End-to-end test on a real cluster", is the recipe.
#
#   scripts/k8s_e2e.sh install   apt packages + the kubernetes source package + helm (scripts/fetch-helm.sh)
#   scripts/k8s_e2e.sh build     kube-apiserver, -controller-manager, -scheduler, kubelet, kubectl (cached
#                                in $AERIE_K8S_CACHE) and the images aerie-e2e, aerie-e2e-redis, aerie-e2e-pause
#   scripts/k8s_e2e.sh up        dockerd, etcd, control plane, kubelet, dnsmasq: all on this machine
#   scripts/k8s_e2e.sh test      helm install, every pod Ready, a chat request == `aerie generate`, a drafter
#                                killed under a running stream, helm upgrade (2 verifier groups), helm uninstall
#   scripts/k8s_e2e.sh down      stop everything started, by PID; remove containers, chains, cgroups, docker0
#   scripts/k8s_e2e.sh all       install build up test, always followed by down (trap)
#
# Network rule: dockerd runs with --iptables=false --ip-forward=false --ip-masq=false; net.ipv4.ip_forward
# stays 0 (checked; if the host has it on, a FORWARD rule drops everything entering or leaving docker0);
# the control plane binds 127.0.0.1; every request goes to 127.0.0.1 or to a pod on docker0.
# Exit status: 0 passed, 1 failed, 77 this machine cannot run it (no docker daemon, not root).
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${AERIE_K8S_CACHE:-/var/cache/aerie-k8s}"
STATE="${AERIE_K8S_STATE:-/run/aerie-k8s}"
VALUES="${AERIE_K8S_VALUES:-$REPO/tests/k8s/values-e2e.yaml}"
K8S_VERSION=v1.20.2
BIN="$CACHE/bin"
RELEASE=aerie
NS=default
APISERVER_PORT=16443
ETCD_PORT=12379
GATEWAY_PORT=18000
IMAGE_TAG=e2e
T0=$(date +%s)
export PATH="$BIN:$PATH"

log() { echo "[k8s_e2e $(date -u +%T) +$(( $(date +%s) - T0 ))s] $*" >&2; }
die() { log "FAIL: $*"; exit 1; }
skip() { log "SKIP: $*"; exit 77; }
timed() { local name=$1 t; shift; t=$(date +%s); "$@"; log "TIME $name $(( $(date +%s) - t ))s"; }

HELM="${HELM:-}"
find_helm() {
    [ -n "$HELM" ] && return
    local c
    for c in "$REPO/.venv/bin/helm" "$REPO/tools/bin/helm" "$(command -v helm || true)"; do
        if [ -n "$c" ] && [ -x "$c" ]; then HELM=$c; return; fi
    done
    die "helm not found: run scripts/fetch-helm.sh"
}
PY="${AERIE_PYTHON:-}"
find_python() {
    [ -n "$PY" ] && return
    # The project's virtual environment (aerie installed): its site-packages go into the image.
    [ -x "$REPO/.venv/bin/python" ] || die "no $REPO/.venv: run scripts/setup.sh or set AERIE_PYTHON to a venv's python"
    PY="$REPO/.venv/bin/python"
}

# ================================================================ install
cmd_install() {
    [ "$(id -u)" = 0 ] || skip "needs root (dockerd, kubelet)"
    if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src' /etc/apt/sources.list; then
        cat > /etc/apt/sources.list.d/aerie-k8s-src.sources <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    fi
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        golang-go etcd-server docker.io debootstrap dnsmasq-base dpkg-dev iptables socat conntrack \
        rsync gcc libc6-dev openssl iproute2 util-linux
    mkdir -p "$CACHE/src"
    if ! ls -d "$CACHE"/src/kubernetes-1.20*/ >/dev/null 2>&1; then
        (cd "$CACHE/src" && apt-get source -q kubernetes)
    fi
    find_helm
    log "install done ($("$HELM" version --short))"
}

# ================================================================ build
build_k8s() {
    local tree; tree=$(ls -d "$CACHE"/src/kubernetes-1.20*/ | head -1); tree=${tree%/}
    local gopath="$CACHE/gopath"
    mkdir -p "$gopath/src/k8s.io" "$BIN"
    ln -sfn "$tree" "$gopath/src/k8s.io/kubernetes"
    # This sandbox cannot set a negative oom_score_adj (kubelet also runs with --oom-score-adj=0).
    # (sed only where the constant is still unpatched: the file's mtime decides what is rebuilt below)
    local f="$tree/pkg/kubelet/dockershim/docker_sandbox.go" q="$tree/pkg/kubelet/qos/policy.go"
    grep -q 'defaultSandboxOOMAdj int = -998' "$f" && sed -i 's/defaultSandboxOOMAdj int = -998/defaultSandboxOOMAdj int = 0/' "$f"
    grep -q 'guaranteedOOMScoreAdj int = -997' "$q" && sed -i 's/guaranteedOOMScoreAdj int = -997/guaranteedOOMScoreAdj int = 0/' "$q"
    (
        export GOPATH="$gopath" GO111MODULE=off GOFLAGS= CGO_ENABLED=0 GOCACHE="$CACHE/gocache" HOME="${HOME:-/root}"
        cd "$gopath/src/k8s.io/kubernetes"
        if [ ! -e "$CACHE/.generated" ]; then
            log "make generated_files"
            make generated_files
            touch "$CACHE/.generated"
        fi
        # Without both version packages the server reports v0.0.0 and helm refuses charts with a kubeVersion.
        local ld="" p c
        for p in k8s.io/component-base/version k8s.io/client-go/pkg/version \
                 k8s.io/kubernetes/vendor/k8s.io/component-base/version k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version; do
            ld="$ld -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=20 -X $p.gitTreeState=clean"
            ld="$ld -X $p.gitCommit=debian-bookworm -X $p.buildDate=1970-01-01T00:00:00Z"
        done
        for c in kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl; do
            if [ -x "$BIN/$c" ] && [ "$BIN/$c" -nt "$q" ] && [ "$BIN/$c" -nt "$f" ]; then continue; fi
            log "go build $c"
            go build -ldflags "-s -w $ld" -o "$BIN/$c.tmp" "./cmd/$c"
            mv "$BIN/$c.tmp" "$BIN/$c"
        done
    )
}

# A Debian rootfs with python3.11 and redis-server, the base of every image.
build_rootfs() {
    local base="$CACHE/rootfs/base"
    if [ ! -e "$base/.done" ]; then
        rm -rf "$base"; mkdir -p "$CACHE/rootfs"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,redis-server \
            bookworm "$base" http://deb.debian.org/debian
        touch "$base/.done"
    fi
}

image_key() { docker image inspect -f '{{ index .Config.Labels "aerie.e2e.key" }}' "$1" 2>/dev/null || true; }

build_images() {
    start_dockerd
    build_rootfs
    local base="$CACHE/rootfs/base"
    # pause: the pod sandbox (no registry to pull k8s.gcr.io/pause from).
    local tree; tree=$(ls -d "$CACHE"/src/kubernetes-1.20*/ | head -1)
    if [ -z "$(docker images -q aerie-e2e-pause:$IMAGE_TAG)" ]; then
        local d; d=$(mktemp -d)
        gcc -Os -static -o "$d/pause" "$tree/build/pause/linux/pause.c"
        tar -C "$d" -c pause | docker import -c 'ENTRYPOINT ["/pause"]' - "aerie-e2e-pause:$IMAGE_TAG"
        rm -rf "$d"
    fi
    # redis: the Debian rootfs as it is (redis-server, redis-cli, sh).
    if [ -z "$(docker images -q aerie-e2e-redis:$IMAGE_TAG)" ]; then
        tar -C "$base" --exclude=./.done -c . | docker import - "aerie-e2e-redis:$IMAGE_TAG"
    fi
    # aerie: the rootfs + a venv at /opt/aerie with the project's site-packages and this tree's sources.
    find_python
    local site; site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PY" -c 'import sys; assert sys.prefix != sys.base_prefix and sys.version_info[:2] == (3, 11)' \
        || die "$PY is not a Python 3.11 virtual environment (the image's Debian python is 3.11)"
    local key; key=$( (sha256sum < "$REPO/scripts/k8s_e2e.sh"; cd "$REPO" && git ls-files -s aerie_cli services coordinator drafter_svc verifier_svc gateway \
        && git diff HEAD -- aerie_cli services coordinator drafter_svc verifier_svc gateway; ls "$site") | sha256sum | cut -c1-16)
    if [ "$(image_key "aerie-e2e:$IMAGE_TAG")" = "$key" ]; then log "image aerie-e2e:$IMAGE_TAG up to date"; return; fi
    local root="$CACHE/rootfs/aerie"
    rsync -a --delete --exclude=/.done "$base/" "$root/"
    chroot "$root" sh -c 'groupadd --system --gid 10001 aerie && useradd --system --uid 10001 --gid aerie \
        --home-dir /home/aerie --create-home --shell /usr/sbin/nologin aerie && install -d -o aerie -g aerie /var/cache/aerie \
        && python3 -m venv --without-pip /opt/aerie'
    local dest="$root/opt/aerie/lib/python3.11/site-packages"
    rsync -a --exclude='__editable__*' --exclude='aerie-*.dist-info' --exclude='__pycache__' "$site/" "$dest/"
    # redis-py imports async_timeout on Python < 3.11.3 (Debian bookworm's python3 is 3.11.2).
    "$PY" -m pip install -q --no-deps --target "$dest" "async-timeout==4.0.3"
    local pkg
    for pkg in aerie_cli services coordinator drafter_svc verifier_svc gateway; do
        (cd "$REPO" && git ls-files -co --exclude-standard "$pkg") | rsync -a --files-from=- "$REPO/" "$dest/"
    done
    printf '#!/opt/aerie/bin/python\nimport sys\nfrom aerie_cli.main import main\nsys.exit(main())\n' > "$root/opt/aerie/bin/aerie"
    chmod 0755 "$root/opt/aerie/bin/aerie"
    tar -C "$root" -c . | docker import \
        -c 'ENV PATH=/opt/aerie/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        -c 'ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 AERIE_CACHE_DIR=/var/cache/aerie HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false' \
        -c 'WORKDIR /home/aerie' -c 'USER 10001:10001' -c 'ENTRYPOINT ["aerie"]' -c 'CMD ["--help"]' \
        -c "LABEL aerie.e2e.key=$key" - "aerie-e2e:$IMAGE_TAG"
}

cmd_build() {
    [ "$(id -u)" = 0 ] || skip "needs root"
    timed build-kubernetes build_k8s
    timed build-images build_images
}

# ================================================================ up
pidfile() { echo "$STATE/pids/$1.pid"; }
alive() { [ -e "$(pidfile "$1")" ] && kill -0 "$(cat "$(pidfile "$1")")" 2>/dev/null; }
spawn() {  # name cmd...: start in the background, PID in $STATE/pids, output in $STATE/logs
    local name=$1; shift
    alive "$name" && return 0
    "$@" > "$STATE/logs/$name.log" 2>&1 &
    echo $! > "$(pidfile "$name")"
}
wait_for() {  # seconds description cmd...
    local n=$1 what=$2; shift 2
    local i
    for ((i = 0; i < n; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 1
    done
    die "timed out after ${n}s waiting for $what"
}

DOCKER_SOCK="$STATE/docker.sock"
export DOCKER_HOST="unix://$DOCKER_SOCK"

check_forwarding() {
    if [ "$(sysctl -n net.ipv4.ip_forward)" != 0 ]; then
        # The host forwards: nothing may enter or leave docker0 through it.
        iptables -N AERIE-E2E 2>/dev/null || true
        iptables -F AERIE-E2E
        iptables -A AERIE-E2E -i docker0 -j DROP
        iptables -A AERIE-E2E -o docker0 -j DROP
        iptables -C FORWARD -j AERIE-E2E 2>/dev/null || iptables -I FORWARD 1 -j AERIE-E2E
        log "net.ipv4.ip_forward is 1 on this host: FORWARD drops everything through docker0"
    fi
}

start_dockerd() {
    mkdir -p "$STATE/pids" "$STATE/logs" "$CACHE/docker"
    command -v dockerd >/dev/null || skip "dockerd not installed (scripts/k8s_e2e.sh install)"
    check_forwarding
    if ! alive dockerd; then
        spawn dockerd dockerd --iptables=false --ip-forward=false --ip-masq=false --ip6tables=false \
            --host "unix://$DOCKER_SOCK" --data-root "$CACHE/docker" --exec-root "$STATE/docker-exec" \
            --pidfile "$STATE/docker.pid" --exec-opt native.cgroupdriver=cgroupfs --storage-driver overlay2 || true
        local i
        for ((i = 0; i < 60; i++)); do
            docker info >/dev/null 2>&1 && break
            alive dockerd || { tail -20 "$STATE/logs/dockerd.log" >&2; skip "the docker daemon does not start here"; }
            sleep 1
        done
        docker info >/dev/null 2>&1 || skip "the docker daemon did not answer within 60 s"
    fi
    [ "$(sysctl -n net.ipv4.ip_forward)" = 0 ] || iptables -C FORWARD -j AERIE-E2E 2>/dev/null \
        || die "net.ipv4.ip_forward turned on and no FORWARD drop rule is in place"
}

docker0_ip() { ip -4 -o addr show docker0 | awk '{print $4}' | cut -d/ -f1; }

make_pki() {
    local pki="$STATE/pki"
    [ -e "$pki/token.csv" ] && return
    mkdir -p "$pki"; chmod 700 "$pki"
    openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
    local token; token=$(openssl rand -hex 24)
    echo "$token,admin,admin,system:masters" > "$pki/token.csv"
    cat > "$STATE/kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- cluster: {server: "https://127.0.0.1:$APISERVER_PORT", insecure-skip-tls-verify: true}
  name: e2e
users:
- name: admin
  user: {token: "$token"}
contexts:
- context: {cluster: e2e, user: admin}
  name: e2e
current-context: e2e
KC
    chmod 600 "$STATE/kubeconfig"
}

start_dnsmasq() {
    local ip=$1
    mkdir -p "$STATE/dns"
    : > "$STATE/dns/services"
    # Serves the cluster's Service names (written by dns_sync from the Endpoints, SIGHUP re-reads them) on
    # docker0 only;
    # --no-resolv: no upstream, nothing else is answered.
    spawn dnsmasq dnsmasq --keep-in-foreground --no-resolv --no-hosts --no-poll --bind-interfaces \
        --listen-address="$ip" --interface=docker0 --except-interface=lo --port=53 --addn-hosts="$STATE/dns/services" \
        --local=/cluster.local/ --local=/svc/ --local-ttl=1 --pid-file= --user=root --log-facility=-
}

# Headless Service names (and StatefulSet pod names) -> ready pod IPs, for dnsmasq: rewritten on every
# Endpoints change (one kubectl watch; a kubectl run per second would take half a core here).
dns_write() {
    local tpl='{{range .items}}{{$svc := .metadata.name}}{{$ns := .metadata.namespace}}{{range .subsets}}{{range .addresses}}{{.ip}} {{$svc}}.{{$ns}}.svc.cluster.local {{$svc}}.{{$ns}}.svc{{if .hostname}} {{.hostname}}.{{$svc}}.{{$ns}}.svc.cluster.local{{end}}{{"\n"}}{{end}}{{end}}{{end}}'
    if kubectl get endpoints -A -o go-template="$tpl" > "$STATE/dns-services.tmp" 2>/dev/null; then
        if ! cmp -s "$STATE/dns-services.tmp" "$STATE/dns/services"; then
            cp "$STATE/dns-services.tmp" "$STATE/dns/services"
            alive dnsmasq && kill -HUP "$(cat "$(pidfile dnsmasq)")"  # re-reads --addn-hosts, clears its cache
        fi
    fi
}
dns_sync() {
    while true; do
        dns_write
        kubectl get endpoints -A --watch-only -o name 2>/dev/null | while read -r _; do dns_write; done
        sleep 1
    done
}

cmd_up() {
    [ "$(id -u)" = 0 ] || skip "needs root"
    local t; t=$(date +%s)
    start_dockerd
    export KUBECONFIG="$STATE/kubeconfig"
    local ip; ip=$(docker0_ip); [ -n "$ip" ] || die "docker0 has no IPv4 address"
    make_pki
    local pki="$STATE/pki"
    spawn etcd etcd --name e2e --data-dir "$STATE/etcd" \
        --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
        --initial-cluster "e2e=http://127.0.0.1:$((ETCD_PORT + 1))"
    spawn kube-apiserver kube-apiserver --bind-address=127.0.0.1 --secure-port=$APISERVER_PORT --insecure-port=0 \
        --advertise-address="$ip" --etcd-servers="http://127.0.0.1:$ETCD_PORT" --cert-dir="$pki/apiserver" \
        --token-auth-file="$pki/token.csv" --authorization-mode=Node,RBAC --anonymous-auth=false \
        --kubelet-preferred-address-types=InternalIP \
        --service-cluster-ip-range=10.96.0.0/16 --service-account-key-file="$pki/sa.pub" \
        --service-account-signing-key-file="$pki/sa.key" --service-account-issuer=https://kubernetes.default.svc \
        --allow-privileged=false --profiling=false
    wait_for 120 "kube-apiserver" kubectl get --raw /readyz
    spawn kube-controller-manager kube-controller-manager --kubeconfig="$STATE/kubeconfig" \
        --bind-address=127.0.0.1 --port=0 --secure-port=10257 --leader-elect=false \
        --service-account-private-key-file="$pki/sa.key" --use-service-account-credentials=false \
        --controllers='*,-nodeipam,-cloud-node-lifecycle,-route,-service' --profiling=false
    spawn kube-scheduler kube-scheduler --kubeconfig="$STATE/kubeconfig" --bind-address=127.0.0.1 --port=0 \
        --secure-port=10259 --leader-elect=false --profiling=false
    start_dnsmasq "$ip"
    : > "$STATE/resolv.conf"
    spawn kubelet kubelet --kubeconfig="$STATE/kubeconfig" --hostname-override=localhost --node-ip="$ip" \
        --address="$ip" --healthz-bind-address=127.0.0.1 --read-only-port=0 --anonymous-auth=true \
        --authorization-mode=AlwaysAllow --container-runtime=docker --docker-endpoint="unix://$DOCKER_SOCK" \
        --pod-infra-container-image="aerie-e2e-pause:$IMAGE_TAG" --root-dir="$STATE/kubelet" \
        --cert-dir="$STATE/kubelet-pki" --cgroup-driver=cgroupfs --fail-swap-on=false --oom-score-adj=0 \
        --make-iptables-util-chains=false --cluster-dns="$ip" --cluster-domain=cluster.local \
        --resolv-conf="$STATE/resolv.conf" --eviction-hard='memory.available<500Mi' --image-gc-high-threshold=100 \
        --serialize-image-pulls=false --register-node=true
    (dns_sync) > "$STATE/logs/dns-sync.log" 2>&1 &
    echo $! > "$(pidfile dns-sync)"
    wait_for 180 "node localhost Ready" kubectl wait --for=condition=Ready node/localhost --timeout=1s
    log "TIME up $(( $(date +%s) - t ))s (cluster $K8S_VERSION on https://127.0.0.1:$APISERVER_PORT, docker0 $ip)"
}

# ================================================================ test
kc() { kubectl -n "$NS" "$@"; }
pods_ready() {  # selector count: exactly count pods, all Ready
    local want=$2 got
    got=$(kc get pods -l "$1" -o go-template='{{range .items}}{{if not .metadata.deletionTimestamp}}{{range .status.conditions}}{{if eq .type "Ready"}}{{.status}}{{"\n"}}{{end}}{{end}}{{end}}{{end}}')
    [ "$(grep -c True <<<"$got")" = "$want" ] && [ "$(grep -c . <<<"$got")" = "$want" ]
}
wait_ready() {  # component count seconds
    local sel="app.kubernetes.io/instance=$RELEASE,app.kubernetes.io/component=$1" i
    for ((i = 0; i < $3; i++)); do
        pods_ready "$sel" "$2" && return 0
        sleep 2
    done
    kc get pods -o wide >&2; kc describe pods -l "$sel" | tail -40 >&2
    die "$1: $2 pods not Ready within $(( $3 * 2 ))s"
}

port_forward() {  # to the HTTP gateway's pod (the chart's default), else a coordinator's own HTTP API
    kill_pid port-forward
    local component=gateway
    [ -n "$(kc get pods -l "app.kubernetes.io/instance=$RELEASE,app.kubernetes.io/component=gateway" -o name)" ] \
        || component=coordinator
    local pod; pod=$(kc get pods -l "app.kubernetes.io/instance=$RELEASE,app.kubernetes.io/component=$component" \
        -o jsonpath='{.items[0].metadata.name}')
    log "HTTP API through $component pod $pod"
    spawn port-forward kubectl -n "$NS" port-forward --address 127.0.0.1 "pod/$pod" "$GATEWAY_PORT:8000"
    wait_for 30 "port-forward to $pod" bash -c "exec 3<>/dev/tcp/127.0.0.1/$GATEWAY_PORT"
}

cmd_test() {
    find_helm; find_python
    export KUBECONFIG="$STATE/kubeconfig"
    local t
    # Redis's PersistentVolumeClaim: a hostPath PV (no provisioner here).
    mkdir -p "$STATE/pv/redis"; chmod 0777 "$STATE/pv/redis"
    kubectl apply -f - <<PV
apiVersion: v1
kind: PersistentVolume
metadata: {name: aerie-e2e-redis}
spec:
  capacity: {storage: 8Gi}
  accessModes: [ReadWriteOnce]
  storageClassName: ""
  persistentVolumeReclaimPolicy: Retain
  hostPath: {path: "$STATE/pv/redis", type: Directory}
PV
    t=$(date +%s)
    local verb=install
    "$HELM" status "$RELEASE" -n "$NS" >/dev/null 2>&1 && verb=upgrade  # a rerun on a cluster that has it
    # helm 4 applies server-side by default, which a 1.20 API server does not do for it.
    "$HELM" "$verb" "$RELEASE" "$REPO/k8s/charts/aerie" -n "$NS" -f "$VALUES" --server-side=false \
        || "$HELM" "$verb" "$RELEASE" "$REPO/k8s/charts/aerie" -n "$NS" -f "$VALUES"
    wait_ready redis 1 300
    wait_ready verifier 1 450
    wait_ready drafter 2 450
    wait_ready coordinator 1 450
    wait_ready gateway 1 300
    log "TIME install-to-ready $(( $(date +%s) - t ))s"
    kc get pods -o wide >&2
    port_forward
    mkdir -p "$STATE/client"
    kc get secret "$RELEASE-tls" -o jsonpath='{.data.ca\.crt}' | base64 -d > "$STATE/client/ca.crt"
    kc get secret "$RELEASE-api-tokens" -o jsonpath='{.data.tokens}' | base64 -d | awk '$1=="default"{print $2}' \
        > "$STATE/client/token"
    t=$(date +%s)
    AERIE_E2E_BASE_URL="https://127.0.0.1:$GATEWAY_PORT/v1" AERIE_E2E_CA="$STATE/client/ca.crt" \
    AERIE_E2E_TOKEN_FILE="$STATE/client/token" AERIE_E2E_STATE="$STATE" DOCKER_HOST="$DOCKER_HOST" \
        "$PY" "$REPO/tests/k8s/e2e_client.py" chat
    log "TIME chat $(( $(date +%s) - t ))s"
    t=$(date +%s)
    AERIE_E2E_BASE_URL="https://127.0.0.1:$GATEWAY_PORT/v1" AERIE_E2E_CA="$STATE/client/ca.crt" \
    AERIE_E2E_TOKEN_FILE="$STATE/client/token" AERIE_E2E_STATE="$STATE" AERIE_E2E_NS="$NS" \
    AERIE_E2E_RELEASE="$RELEASE" DOCKER_HOST="$DOCKER_HOST" \
        "$PY" "$REPO/tests/k8s/e2e_client.py" failover
    log "TIME failover $(( $(date +%s) - t ))s"
    wait_ready drafter 2 300
    t=$(date +%s)
    "$HELM" upgrade "$RELEASE" "$REPO/k8s/charts/aerie" -n "$NS" -f "$VALUES" --set verifier.groups=2 --server-side=false \
        || "$HELM" upgrade "$RELEASE" "$REPO/k8s/charts/aerie" -n "$NS" -f "$VALUES" --set verifier.groups=2
    wait_ready verifier 2 450
    wait_ready coordinator 1 300
    wait_ready gateway 1 300
    port_forward
    AERIE_E2E_BASE_URL="https://127.0.0.1:$GATEWAY_PORT/v1" AERIE_E2E_CA="$STATE/client/ca.crt" \
    AERIE_E2E_TOKEN_FILE="$STATE/client/token" AERIE_E2E_STATE="$STATE" \
        "$PY" "$REPO/tests/k8s/e2e_client.py" chat
    log "TIME upgrade-2-verifiers $(( $(date +%s) - t ))s"
    kill_pid port-forward
    t=$(date +%s)
    "$HELM" uninstall "$RELEASE" -n "$NS" --wait 2>/dev/null || "$HELM" uninstall "$RELEASE" -n "$NS"
    local i left
    for ((i = 0; i < 150; i++)); do
        left=$(kc get all,configmap,secret,serviceaccount,pdb,networkpolicy -l "app.kubernetes.io/instance=$RELEASE" -o name 2>/dev/null)
        [ -z "$left" ] && break
        sleep 2
    done
    [ -z "$left" ] || die "left after helm uninstall: $left"
    # StatefulSet volumeClaimTemplates' PVCs outlive the release by Kubernetes design: the only thing left.
    left=$(kc get pvc -o name)
    [ "$left" = "persistentvolumeclaim/data-$RELEASE-redis-0" ] || die "PVCs after uninstall: '$left'"
    kc delete pvc "data-$RELEASE-redis-0" --wait=true
    kubectl delete pv aerie-e2e-redis --wait=true
    log "TIME uninstall $(( $(date +%s) - t ))s (nothing with the release label is left; Redis's PVC deleted by the test)"
    [ "$(sysctl -n net.ipv4.ip_forward)" = 0 ] || iptables -C FORWARD -j AERIE-E2E 2>/dev/null \
        || die "net.ipv4.ip_forward is 1 without the FORWARD drop rule"
    log "PASS"
}

# ================================================================ down
kill_pid() {  # name: SIGTERM, then SIGKILL after 20 s
    local f; f=$(pidfile "$1")
    [ -e "$f" ] || return 0
    local pid; pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
        local i
        for ((i = 0; i < 20; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}

cmd_down() {
    [ -d "$STATE" ] || return 0
    set +e
    kill_pid port-forward
    if alive dns-sync; then pkill -TERM -P "$(cat "$(pidfile dns-sync)")" || true; fi  # its kubectl watch
    kill_pid dns-sync
    kill_pid kubelet
    if alive dockerd; then
        local ids; ids=$(docker ps -aq --filter label=io.kubernetes.pod.name)
        [ -z "$ids" ] || docker rm -f $ids >/dev/null
    fi
    kill_pid dnsmasq
    kill_pid kube-scheduler
    kill_pid kube-controller-manager
    kill_pid kube-apiserver
    kill_pid etcd
    kill_pid dockerd
    # kubelet's mounts (emptyDir tmpfs, secrets) and its QoS cgroups.
    if [ -d "$STATE/kubelet" ]; then
        grep " $STATE/" /proc/self/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l
    fi
    local c
    for c in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/*/kubepods.slice /sys/fs/cgroup/kubepods; do
        [ -d "$c" ] && find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null
    done
    for c in /sys/fs/cgroup/*/docker; do
        [ -d "$c" ] && find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null
    done
    # Chains: kubelet runs with --make-iptables-util-chains=false and dockerd with --iptables=false;
    # remove anything named KUBE-*, DOCKER* or AERIE-E2E all the same.
    local table rule chain
    for table in filter nat mangle; do
        iptables -t "$table" -S 2>/dev/null | grep -E '^-A .*-j (KUBE-|DOCKER|AERIE-E2E)' | sed 's/^-A/-D/' | while read -r rule; do
            eval iptables -t "$table" "$rule"
        done
        for chain in $(iptables -t "$table" -S 2>/dev/null | awk '$1=="-N" && $2 ~ /^(KUBE-|DOCKER|AERIE-E2E)/ {print $2}'); do
            iptables -t "$table" -F "$chain"; iptables -t "$table" -X "$chain"
        done
    done
    ip link show docker0 >/dev/null 2>&1 && ip link delete docker0
    rm -rf "$STATE"
    set -e
    log "down: processes stopped, containers, mounts, cgroups, chains and docker0 removed"
}

cmd_all() {
    trap cmd_down EXIT
    timed install cmd_install
    timed build cmd_build
    timed up cmd_up
    timed test cmd_test
}

case "${1:-}" in
    install) cmd_install ;;
    build) cmd_build ;;
    build-k8s) build_k8s ;;
    images) build_images ;;
    up) cmd_up ;;
    test) cmd_test ;;
    down) cmd_down ;;
    all) cmd_all ;;
    *) echo "usage: $0 install|build|up|test|down|all" >&2; exit 2 ;;
esac
