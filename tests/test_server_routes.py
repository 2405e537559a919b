"""Which key each route asks for, now that every router declares its own check.

No model is loaded: the app's lifespan never runs, so the worker stays "loading" and a request
that passes the key check gets the 503 "model is still loading" (or a 400 for its body). That is
enough to tell "refused for the key" from "let through".
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from dflash2_mlx.server import ServerConfig, create_app

KEY = "sekret"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi", "max_tokens": 4}
# (method, path) of each route, grouped by the header that carries its key
OPENAI_ROUTES = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/resp_1"),
    ("DELETE", "/v1/responses/resp_1"),
]
ANTHROPIC_ROUTES = [("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens")]
MODEL_ROUTES = [("GET", "/v1/models"), ("GET", "/v1/models/m")]
BEARER = {"authorization": f"Bearer {KEY}"}
X_API_KEY = {"x-api-key": KEY}


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = create_app(ServerConfig(model="m", api_key=KEY))
    return TestClient(app, raise_server_exceptions=False)


def _send(client: TestClient, method: str, path: str, headers: dict):
    return client.request(method, path, json=BODY if method == "POST" else None, headers=headers)


@pytest.mark.parametrize("method,path", OPENAI_ROUTES + ANTHROPIC_ROUTES + MODEL_ROUTES)
def test_every_api_route_refuses_a_request_without_the_key(client, method, path):
    r = _send(client, method, path, {})
    assert r.status_code == 401, r.text
    assert "missing API key" in r.text


@pytest.mark.parametrize("method,path", OPENAI_ROUTES)
def test_openai_routes_take_the_key_as_a_bearer_token_only(client, method, path):
    assert _send(client, method, path, BEARER).status_code != 401
    r = _send(client, method, path, X_API_KEY)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("method,path", ANTHROPIC_ROUTES)
def test_anthropic_routes_take_the_key_in_x_api_key_and_answer_in_anthropic_shape(client, method, path):
    assert _send(client, method, path, X_API_KEY).status_code != 401
    r = _send(client, method, path, {"x-api-key": "wrong"})
    assert r.status_code == 401
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    assert "send the server's --api-key in the x-api-key header" in r.json()["error"]["message"]


@pytest.mark.parametrize("method,path", MODEL_ROUTES)
def test_model_routes_take_the_key_in_either_header(client, method, path):
    assert _send(client, method, path, BEARER).status_code == 200
    assert _send(client, method, path, X_API_KEY).status_code == 200


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_health_and_metrics_need_no_key(client, path):
    assert client.get(path).status_code in (200, 503)  # /health is 503 until the model is ready
    assert "API key" not in client.get(path).text


def test_a_route_that_passes_the_key_check_reaches_the_readiness_check(client):
    r = _send(client, "POST", "/v1/chat/completions", BEARER)
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
