"""Tensor parallelism, rank 0's side: start the other ranks, and a ModelRunner whose forwards they join.

Rank 0 is the engine (scheduler, speculators, sampler: all unchanged) with shard 0 of the target; ranks
1..N-1 are processes of server/engine/tp_worker.py with the other shards. Each forward rank 0 runs —
a step's verification, the goodput policy's start-up timings — is first broadcast as one message (the
step's batch as plain lists), so every rank runs the same forward and meets the same collectives.

Drafters stay on rank 0, unsharded: a draft model is small (sharding it would add two all-reduces per layer
to every draft token, which costs more than its matmuls save), and EAGLE-3 / MTP heads get full copies of
the embedding and lm_head they share with the target (server/models/parallel_layers.py).

A rank that dies fails the step that needs it, with an error naming it, so the engine is marked dead
(requests fail, /health turns 503) instead of waiting on a collective that never completes.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import socket
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from specserve.server.config import EngineConfig
from specserve.server.engine.model_runner import ModelRunner, StepBatch, StepResult
from specserve.server.engine.scheduler import ScheduledSeq
from specserve.server.engine.tp_worker import KVCall, StepCall, StopCall, TimeCall, TPLaunch, join_group, worker_main
from specserve.server.models.config import ModelConfig
from specserve.server.models.parallel_layers import ShardedLlamaForCausalLM, TPGroup
from specserve.server.models.shard_loader import check_shardable, load_sharded_model

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
DEATH_WAIT_S = 1.0          # after a failed collective: time for a killed rank to be reaped


class TPRankDied(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPSession:
    """The group as rank 0 sees it: the worker processes, the control channel, and shutting them down."""

    def __init__(self, launch: TPLaunch) -> None:
        ctx = multiprocessing.get_context("spawn")      # fork would copy this process's threads' locks
        self.launch = launch
        self.procs = [ctx.Process(target=worker_main, args=(rank, launch), name=f"specserve-tp-{rank}", daemon=True)
                      for rank in range(1, launch.world_size)]
        for proc in self.procs:
            proc.start()
        self.closed = False
        try:
            group, self.control = join_group(launch, 0)
        except BaseException:
            self.close()
            raise
        self.group = TPGroup(0, launch.world_size, group)
        self._finalizer = weakref.finalize(self, TPSession._stop_procs, self.procs)
        atexit.register(self.close)

    def check_alive(self, wait_s: float = 0.0) -> None:
        """TPRankDied naming the first rank that has exited. wait_s: after a failed collective, how long a
        rank that is going (its sockets already closed) may take to be reaped."""
        for rank, proc in enumerate(self.procs, start=1):
            if wait_s > 0.0:
                proc.join(wait_s / len(self.procs))
            if not proc.is_alive():
                raise TPRankDied(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}; "
                                 "the engine cannot run without it: restart the server")

    def send(self, msg: object) -> None:
        self.check_alive()
        dist.broadcast_object_list([msg], src=0, group=self.control)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if dist.is_initialized():
            try:
                if all(p.is_alive() for p in self.procs):
                    dist.broadcast_object_list([StopCall()], src=0, group=self.control)
            except RuntimeError as exc:
                log.warning("could not tell the tensor-parallel ranks to stop: %s", exc)
        TPSession._stop_procs(self.procs)
        if dist.is_initialized():
            dist.destroy_process_group()

    @staticmethod
    def _stop_procs(procs: list) -> None:
        for proc in procs:
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join(STOP_TIMEOUT_S)


class TPModelRunner(ModelRunner):
    """ModelRunner on shard 0; `cfg` is the full model's config (what speculators size themselves by), the
    KV cache holds this rank's KV heads only."""

    def __init__(self, model: ShardedLlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, session: TPSession) -> None:
        super().__init__(model, model.config, num_blocks, block_size, dtype, device)
        self.cfg = model.full_config
        self.session = session
        self._pending: tuple[StepBatch, StepCall] | None = None
        session.send(KVCall(num_blocks, block_size))

    def prepare(self, seqs: list[ScheduledSeq], drafts: list[list[int]]) -> StepBatch:
        batch = super().prepare(seqs, drafts)
        seq_lens = [s.request.num_computed_tokens + q for s, q in zip(seqs, batch.query_lens)]
        call = StepCall(batch.input_ids.tolist(), list(batch.query_lens), seq_lens,
                        [list(s.request.block_ids) for s in seqs], batch.logits_indices.tolist(),
                        tuple(self.aux_layer_ids))
        self._pending = (batch, call)
        return batch

    def execute(self, batch: StepBatch) -> StepResult:
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not batch:
            raise RuntimeError("a tensor-parallel forward runs only on a batch from this runner's prepare()")
        return self._collective(lambda: super(TPModelRunner, self).execute(batch), pending[1])

    def time_verify_step(self, num_seqs: int, query_len: int, context_len: int, reps: int = 3) -> float:
        return self._collective(lambda: super(TPModelRunner, self).time_verify_step(
            num_seqs, query_len, context_len, reps), TimeCall(num_seqs, query_len, context_len, reps))

    def _collective(self, run, msg: object):
        try:
            self.session.send(msg)          # its broadcast fails too when a rank died after the liveness check
            return run()
        except TPRankDied:
            raise
        except RuntimeError as exc:      # a failed collective: say which rank is gone when one is
            self.session.check_alive(wait_s=DEATH_WAIT_S)
            raise TPRankDied(f"a tensor-parallel collective failed: {exc}") from exc

    def close(self) -> None:
        self.session.close()


def start_sharded(cfg: EngineConfig, model_dir: Path | None, mcfg: ModelConfig, dtype: torch.dtype,
                  device: torch.device) -> tuple[ShardedLlamaForCausalLM, TPSession]:
    """Start ranks 1..N-1, join the group and load shard 0 here (the ranks load theirs at the same time)."""
    world = cfg.tensor_parallel_size
    check_shardable(mcfg, world)                      # before any process starts
    if device.type == "cuda" and (device.index or 0) + world > torch.cuda.device_count():
        raise ValueError(f"--tensor-parallel-size {world} from {device} needs GPUs up to cuda:"
                         f"{(device.index or 0) + world - 1}; this machine has {torch.cuda.device_count()}")
    threads = None
    if device.type == "cpu":    # N ranks share the cores: N x all cores would oversubscribe every one
        threads = cfg.num_threads or max(1, (os.cpu_count() or 1) // world)
        torch.set_num_threads(threads)
    launch = TPLaunch(world, _free_port(), None if model_dir is None else str(model_dir), mcfg,
                      str(dtype).removeprefix("torch."), str(device), cfg.seed, threads,
                      logging.getLogger().getEffectiveLevel())
    session = TPSession(launch)
    try:
        model = load_sharded_model(model_dir, mcfg, session.group, dtype, device, cfg.seed)
    except BaseException:
        session.close()
        raise
    log.info("tensor parallel: %d ranks (%s), shard 0 loaded", world, launch.backend)
    return model, session
