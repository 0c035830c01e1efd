"""`lockstep serve`'s uvicorn server: `/health` and `/ping` answered off its event loop by the health listener
process (`lockstep_common/health_listener.py`, shared with the gateway), with the x-request-id the app's
GuardMiddleware gives every answer. `entrypoints/serve.py` subclasses it with the drain and `probe_answer`.
"""

from __future__ import annotations

import uvicorn
from lockstep_common.health_listener import PROBE_PATHS
from lockstep_common.health_server import HealthListenerMixin

__all__ = ["PROBE_PATHS", "HealthListenerServer"]


class HealthListenerServer(HealthListenerMixin, uvicorn.Server):
    probe_request_ids = True
