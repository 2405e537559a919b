"""The operator's routes, without a key: /health (200 when ready, else 503) and /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.responses import JSONResponse, PlainTextResponse

from dflash2_mlx.server.dependencies import ServerState, server_state

router = APIRouter()


@router.get("/health")
async def health(server: ServerState = Depends(server_state)):
    worker = server.worker
    body = {
        "status": {"ready": "ok"}.get(worker.state, worker.state),
        "model": server.names[0],
        "queue_depth": worker.queue_depth(),
        "active": worker.active_requests(),
        "busy": worker.busy(),
    }
    if worker.error:
        body["error"] = worker.error
    return JSONResponse(body, status_code=200 if worker.state == "ready" else 503)


@router.get("/metrics")
async def get_metrics(server: ServerState = Depends(server_state)):
    return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
