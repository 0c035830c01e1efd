"""The gateway's `/health` answer, built on the event loop for the route and off it for the health listener."""

from __future__ import annotations

from starlette.responses import JSONResponse

from lockstep_gateway.backends import Registry


def health_response(registry: Registry) -> JSONResponse:
    """The gateway is up: how many engines it knows, how many are healthy, and the models they serve. Also built
    by the listener's publisher thread while the loop changes the engine table, so it reads a copy of that table
    (made by one C call, under the GIL) and each engine's attributes once."""
    backends = list(registry.backends.values())
    healthy = [backend for backend in backends if backend.healthy]
    models = list(dict.fromkeys(model for backend in healthy for model in backend.models))
    return JSONResponse({"status": "ok", "engines": len(backends), "healthy_engines": len(healthy), "models": models})


def ready_response(registry: Registry) -> JSONResponse:
    """/ready, the readiness probe: 200 once the gateway can serve, 503 before. It can when an engine is
    healthy, or when discovery has listed the cluster and found no engine at all: no LLMService, or only
    services at zero groups, whose requests wait in the queue while they scale up (refusing them would
    keep them at zero). Engines known but none healthy yet (starting, or failing): not ready."""
    healthy = registry.healthy()
    listed = bool(registry.declared_models)  # Kubernetes discovery declares models on every listing
    ready = bool(healthy) or (listed and not registry.backends)
    declared = sorted(set().union(*registry.declared_models.values()))
    reason = "ready" if ready else ("no healthy engine" if registry.backends else "discovery has not listed engines yet")
    body = {"status": reason, "engines": len(registry.backends), "healthy_engines": len(healthy), "declared_models": declared}
    return JSONResponse(body, status_code=200 if ready else 503)


def probe_answer(registry: Registry) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """/health's status, headers and body for the health listener (lockstep_common/health_server.py publishes it
    every 50 ms)."""
    response = health_response(registry)
    return response.status_code, response.raw_headers, response.body
