"""What operators and load balancers ask of the router itself: ``/health`` (the process
answers), ``/ready`` (some worker is healthy), ``/metrics`` (Prometheus) and the models
the fleet serves (``/v1/models``)."""

from __future__ import annotations

from router import __version__
from router.edge.routes import Answer, Call, json_answer

PROMETHEUS_TEXT = ((b"Content-Type", b"text/plain; version=0.0.4"),)


async def health(call: Call) -> Answer:
    return json_answer({"status": "ok", "version": __version__})


async def ready(call: Call) -> Answer:
    healthy = [w.name for w in call.state.router.fleet.all() if w.healthy]
    return json_answer(
        {"ready": bool(healthy), "healthy_workers": healthy}, 200 if healthy else 503
    )


async def models(call: Call) -> Answer:
    names = sorted(call.state.router.fleet.models())
    return json_answer(
        {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "kvrouter"}
                for name in names
            ],
        }
    )


async def metrics(call: Call) -> Answer:
    return Answer(200, call.state.metrics.render(), PROMETHEUS_TEXT)
