from __future__ import annotations

import pytest

from tests.top.jobs import detached_job


@pytest.fixture(scope="package")
def torch_job(tmp_path_factory):
    """One real trainer with 2 DataLoader workers, shared by the live-view tests."""
    with detached_job(tmp_path_factory.mktemp("job"), "--td-live") as job:
        yield job
