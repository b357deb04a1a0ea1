"""Fixtures for the Helm chart tests (helpers in tests/k8s/chart.py)."""

from __future__ import annotations

import pytest

from tests.k8s.chart import VALUE_SETS, Render, find_helm, render


@pytest.fixture(scope="session")
def helm() -> str:
    path = find_helm()
    if path is None:
        pytest.fail("helm not found: run scripts/fetch-helm.sh (scripts/setup.sh does) or set $HELM")
    return path


@pytest.fixture(scope="session", params=list(VALUE_SETS))
def rendered(request, helm) -> Render:
    """The chart rendered with each value set in turn (test ids: default, scale, external-redis)."""
    return render(helm, VALUE_SETS[request.param])


@pytest.fixture(scope="session")
def default_render(helm) -> Render:
    return render(helm, VALUE_SETS["default"])


@pytest.fixture(scope="session")
def scale_render(helm) -> Render:
    return render(helm, VALUE_SETS["scale"])


@pytest.fixture(scope="session")
def external_render(helm) -> Render:
    return render(helm, VALUE_SETS["external-redis"])
