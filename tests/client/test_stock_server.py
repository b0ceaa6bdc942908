"""Client tools pointed at a vLLM server without minipic say so and stop (one start, CPU).

Such a server would answer every span prefill and store nothing; before the
server published its settings, `minipic-preload` reported those spans as
prefilled. The server here has minipic installed but off, which answers exactly
as a stock server does: no /v1/minipic/settings route (404).
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import api_server

from minipic.client.backends import OpenAIServerBackend
from minipic.client.backends.server_settings import NotAMinipicServerError
from minipic.client.preload.cli import main

pytestmark = pytest.mark.engine
EXAMPLES = Path(__file__).parents[2] / "examples" / "corpus"


@pytest.fixture(scope="module")
def url(tiny_model, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("stock-server") / "server.log"
    with api_server(tiny_model, log_path, "--max-model-len", "1024") as base_url:
        yield base_url


def test_preload_stops_with_exit_2_and_stores_nothing(url, tmp_path, capfd):
    manifest = tmp_path / "manifest.parquet"
    code = main([str(EXAMPLES), "--url", url, "--manifest", str(manifest), "--no-progress"])
    assert code == 2
    assert "does not run minipic" in capfd.readouterr().err
    assert not manifest.exists()


def test_rag_backend_refuses_to_connect(url):
    with pytest.raises(NotAMinipicServerError, match="does not run minipic"):
        asyncio.run(OpenAIServerBackend.connect(url))


def test_settings_route_is_a_404(url):
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(f"{url}/v1/minipic/settings", timeout=10)
    assert error.value.code == 404


def test_preload_route_is_a_404(url):
    request = urllib.request.Request(f"{url}/v1/minipic/preload", data=b'{"documents": ["a"]}',
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=10)
    assert error.value.code == 404
