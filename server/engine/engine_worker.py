"""The engine process's main loop (process_engine.ProcessEngine starts it with multiprocessing "spawn").

Builds the engine from the EngineConfig, says Ready(EngineInfo) or Failed(exception, traceback) on the
pipe, then steps while there is work, taking commands between steps (server/engine/messages.py lists
the messages both ways).
The front end owns the signals: this process ignores SIGINT/SIGTERM (a Ctrl-C reaches the whole
process group, and the server must drain first) and exits when told to stop or when the pipe closes.
"""
from __future__ import annotations

import logging
import pickle
import signal
import traceback
from multiprocessing.connection import Connection

from specserve.server.config import EngineConfig
from specserve.server.engine.messages import (
    Dead,
    EngineInfo,
    Failed,
    Gauges,
    GaugesChanged,
    Ready,
    Reply,
    StepDone,
    Stop,
)

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5


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
    from specserve.server.engine.builder import build_engine, resolve_model_dir
    try:
        engine, name = build_engine(cfg)
        info = EngineInfo(name, list(engine.spec.methods), engine.checks, str(resolve_model_dir(cfg)[1]))
    except BaseException as exc:  # noqa: BLE001 - re-raised by the front end: a bad --model reads as one
        conn.send(Failed(picklable(exc), traceback.format_exc()))
        return
    from specserve.server.heap import freeze_startup_objects
    freeze_startup_objects()
    conn.send(Ready(info))
    try:
        _serve(conn, engine)
    except (EOFError, OSError):    # the front end went away: nothing is left to serve
        pass
    finally:
        engine.runner.close()      # tensor-parallel ranks, if any


def _serve(conn: Connection, engine) -> None:
    from specserve.server.engine.async_engine import apply_command

    def reply(rid: str, item) -> None:
        conn.send(Reply(rid, picklable(item) if isinstance(item, BaseException) else item))

    gauges = _gauges(engine)
    while True:
        timeout = 0.0 if engine.has_work else IDLE_POLL_S
        while conn.poll(timeout):
            cmd = conn.recv()
            if isinstance(cmd, Stop):
                return
            apply_command(engine, cmd, reply)
            timeout = 0.0
        if not engine.has_work:
            now = _gauges(engine)
            if now != gauges:
                gauges = now
                conn.send(GaugesChanged(now))
            continue
        try:
            outputs, stats = engine.step()
        except Exception as exc:   # an engine bug must fail requests, not hang them
            log.exception("engine step failed")
            conn.send(Dead(picklable(exc)))
            return
        gauges = _gauges(engine)
        conn.send(StepDone(outputs, stats, gauges))


def _gauges(engine) -> Gauges:
    s = engine.scheduler
    return Gauges(len(s.running), len(s.waiting), s.bm.num_free_blocks)
