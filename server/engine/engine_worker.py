"""The engine process's main loop (process_engine.ProcessEngine starts it with multiprocessing "spawn").

Builds the engine from the EngineConfig, says ("ready", EngineInfo) or ("failed", exception, traceback)
on the pipe, then steps while there is work, taking commands between steps. Messages to the front end:
  ("step", outputs, StepStats, Gauges)   once per step
  ("reply", request_id, item)            a refused add (the exception) or an abort's final output
  ("gauges", Gauges)                     load changed while idle (e.g. an abort of a waiting request)
  ("dead", exception)                    a step raised; the process then exits
Commands: ("add", ...) and ("abort", rid) as async_engine.apply_command takes them, and ("stop",).
The front end owns the signals: this process ignores SIGINT/SIGTERM (a Ctrl-C reaches the whole
process group, and the server must drain first) and exits when told to stop or when the pipe closes.
"""
from __future__ import annotations

import logging
import pickle
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from server.config import EngineConfig
from server.engine.request_checks import RequestChecks

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    methods: list[str]
    checks: RequestChecks
    tokenizer_dir: str


@dataclass(frozen=True)
class Gauges:
    num_running: int
    num_waiting: int
    num_free_kv_blocks: int


def picklable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling (ValueError and kin do), else a RuntimeError that keeps its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to pickle means: send its text instead
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def worker_main(conn: Connection, cfg: EngineConfig, log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from server.engine.builder import build_engine, resolve_model_dir
    try:
        engine, name = build_engine(cfg)
        info = EngineInfo(name, list(engine.spec.methods), engine.checks, str(resolve_model_dir(cfg)[1]))
    except BaseException as exc:  # noqa: BLE001 - re-raised by the front end: a bad --model reads as one
        conn.send(("failed", picklable(exc), traceback.format_exc()))
        return
    conn.send(("ready", info))
    try:
        _serve(conn, engine)
    except (EOFError, OSError):    # the front end went away: nothing is left to serve
        pass


def _serve(conn: Connection, engine) -> None:
    from server.engine.async_engine import apply_command

    def reply(rid: str, item) -> None:
        conn.send(("reply", rid, picklable(item) if isinstance(item, BaseException) else item))

    gauges = _gauges(engine)
    while True:
        timeout = 0.0 if engine.has_work else IDLE_POLL_S
        while conn.poll(timeout):
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            apply_command(engine, cmd, reply)
            timeout = 0.0
        if not engine.has_work:
            now = _gauges(engine)
            if now != gauges:
                gauges = now
                conn.send(("gauges", now))
            continue
        try:
            outputs, stats = engine.step()
        except Exception as exc:   # an engine bug must fail requests, not hang them
            log.exception("engine step failed")
            conn.send(("dead", picklable(exc)))
            return
        gauges = _gauges(engine)
        conn.send(("step", outputs, stats, gauges))


def _gauges(engine) -> Gauges:
    s = engine.scheduler
    return Gauges(len(s.running), len(s.waiting), s.bm.num_free_blocks)
