"""A replica that cannot start (its KV cache does not fit) as users meet it under `serve run`: the
replica log names the settings to change, Serve gives up on the deployment (DEPLOY_FAILED) instead
of retrying forever, and the HTTP API answers 503 OpenAI errors meanwhile, not 500s or hangs."""

import time

import httpx

from bench.servers import serve_run


def test_kv_cache_that_does_not_fit_fails_the_deployment_with_its_reason(tmp_path):
    def edit(config: dict) -> None:
        (app,) = config["applications"]
        app["args"]["engine"].update(model="tiny-llama", num_kv_blocks=10**11)  # beyond any address space
        app["args"]["model_id"] = "tiny-llama"

    with serve_run(tmp_path, edit, wait=False) as url:
        log = tmp_path / "server.log"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and "Failed to update the deployments ['LLMServer']" not in log.read_text():
            time.sleep(1)
        text = log.read_text()
        assert "Failed to update the deployments ['LLMServer']" in text, text[-3000:]  # DEPLOY_FAILED
        assert "KVCacheAllocationError: could not allocate the KV cache on cpu: 100000000000 blocks" in text
        assert "lower engine.kv_cache_memory or engine.num_kv_blocks" in text
        attempts = text.count("KVCacheAllocationError: could not allocate")
        assert 1 <= attempts <= 6, attempts  # Serve's constructor retries are bounded

        body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}
        for method, path, kwargs in (("POST", "/v1/completions", {"json": body}),
                                     ("POST", "/v1/completions", {"json": {**body, "stream": True}}),
                                     ("GET", "/v1/models", {})):
            r = httpx.request(method, url + path, timeout=30, **kwargs)
            assert r.status_code == 503, (path, r.status_code, r.text)
            error = r.json()["error"]
            assert error["code"] == "engine_unavailable" and "failed to start" in error["message"], error
            assert r.headers.get("retry-after")
        assert httpx.get(url + "/health", timeout=30).status_code == 503
