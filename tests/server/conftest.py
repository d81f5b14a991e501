"""Session fixtures: one shared demo-model server (``server``) for the whole test session; tests
that need other flags (API key, queue bound) or kill their server start their own
``ServerProcess``.
"""
from __future__ import annotations

import signal

import httpx
import pytest

from server_process import ServerProcess


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.log_path.read_text()


@pytest.fixture(scope="session")
def model_name(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
