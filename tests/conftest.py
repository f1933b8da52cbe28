"""Suite-wide fixtures.

``anyio_backend``: tests marked ``@pytest.mark.anyio`` run once under asyncio and once under trio;
a module that needs one backend (ZeroMQ tests use ``zmq.asyncio``) overrides the fixture.
"""

from __future__ import annotations

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param
