"""Lifecycle: liveness vs readiness, graceful drain on SIGTERM, and which probes need the API key.

States a server goes through, and what the probes say:

    loading -> ready -> draining -> (exit 0)          /health   /ready   /v1/*
    loading  (model being built)                        503       503      503
    ready                                               200       200      served
    draining (SIGTERM seen, in-flight finishing)        200       503      503 (OpenAI body)
    failed   (load failed) / unhealthy (engine died)    503       503      503 / 500

`/health` is liveness: it fails only when restarting the process is the fix. `/ready` is readiness:
take this replica out of the load balancer. A drain waits for the in-flight /v1 requests up to
`drain_timeout` seconds; whatever is still running then is failed with a 503 error body (a streamed
request gets it as its last event), never silently cut.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("specserve.api")


@dataclass(frozen=True)
class LifecycleConfig:
    drain_timeout: float = 30.0     # seconds a SIGTERM waits for in-flight requests before failing them
    public_health: bool = True      # /health and /ready answer without the API key (probes)
    public_metrics: bool = False    # /metrics answers without the API key

    def validate(self) -> None:
        if not 0 <= self.drain_timeout <= 3600:
            raise ValueError(f"drain_timeout must be in [0, 3600] seconds, got {self.drain_timeout}")


class Lifecycle:
    """Runtime side: the in-flight count (kept by server/api/guard.py) and the drain."""

    def __init__(self, config: LifecycleConfig) -> None:
        self.config = config
        self.draining = False
        self.in_flight = 0                 # /v1 requests whose response has not finished

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1

    async def drain(self, cut: Callable[[], None], poll_s: float = 0.05) -> bool:
        """Stop admitting, wait for in-flight requests up to the deadline, then `cut()` the rest.

        Returns True when everything finished by itself. Idempotent: a second call just waits again.
        """
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout
        logger.warning("draining: %d request(s) in flight, waiting up to %.1fs", self.in_flight,
                       self.config.drain_timeout)
        while self.in_flight > 0 and loop.time() < deadline:
            await asyncio.sleep(poll_s)
        if self.in_flight == 0:
            logger.warning("drained: no request in flight")
            return True
        logger.warning("drain deadline passed: failing %d request(s) still in flight", self.in_flight)
        cut()
        grace = loop.time() + 5.0          # they get their error body; then uvicorn closes what is left
        while self.in_flight > 0 and loop.time() < grace:
            await asyncio.sleep(poll_s)
        return False
