"""Fixtures of the Ray backend tests; import them into a test module (``from tests.conftest_ray import ...``).

``ray_cluster``: the session's 4-node cluster (``tests/ray_helpers.py``), started once. ``clean_cluster``: the
same cluster for one test; afterwards every removed worker node is added back and nothing of any deployment
may be left (engine actors, placement groups, stand-ins, routers); a placement group the test itself creates
(a trainer's) is removed by the test first.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.ray_helpers import FakeCluster, start_cluster, stop_cluster


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[FakeCluster]:
    fake = start_cluster()
    try:
        yield fake
    finally:
        stop_cluster(fake)


@pytest.fixture
def clean_cluster(ray_cluster: FakeCluster) -> Iterator[FakeCluster]:
    ray_cluster.assert_clean(wait_s=5)
    yield ray_cluster
    try:
        ray_cluster.assert_clean()
    finally:
        ray_cluster.restore()
