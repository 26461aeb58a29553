"""A tensor-parallel rank > 0: one process that holds its shard of the target and its KV cache shard, and runs
every forward rank 0 runs (server/engine/tp_runner.py starts it with multiprocessing "spawn").

It has no scheduler, sampler or speculator: rank 0 decides everything and broadcasts each step's batch
(token ids, query and context lengths, block tables, logits rows) as one message on the control group; the
worker rebuilds the attention metadata from it and joins the forward's collectives. It exits when told to
stop, when a collective fails (a peer died), or when its parent process is gone.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from specserve.server.models.config import ModelConfig

log = logging.getLogger(__name__)

# Ranks wait for the next step for as long as the server is idle: the control group never times out a wait.
IDLE_TIMEOUT = timedelta(days=365)
# A collective of a forward (NCCL) that has not finished in this time means a rank is stuck.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
PARENT_POLL_S = 1.0


@dataclass(frozen=True)
class TPLaunch:
    """What every rank needs to join the group and build its shard (picklable)."""
    world_size: int
    port: int
    model_dir: str | None            # None: the seeded random model (build_random_model)
    model_config: ModelConfig        # the full model's
    dtype: str                       # torch dtype name, e.g. "float32"
    device: str                      # rank 0's device; rank r uses cuda:(index + r) on CUDA
    seed: int
    num_threads: int | None          # torch threads per rank on CPU
    log_level: int = logging.WARNING

    def rank_device(self, rank: int) -> torch.device:
        base = torch.device(self.device)
        if base.type != "cuda":
            return base
        return torch.device("cuda", (base.index or 0) + rank)

    @property
    def backend(self) -> str:
        return "nccl" if torch.device(self.device).type == "cuda" else "gloo"


@dataclass(frozen=True)
class KVCall:
    num_blocks: int
    block_size: int


@dataclass(frozen=True)
class StepCall:
    input_ids: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    logits_indices: list[int]
    aux_layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class TimeCall:
    num_seqs: int
    query_len: int
    context_len: int
    reps: int


@dataclass(frozen=True)
class StopCall:
    pass


def join_group(launch: TPLaunch, rank: int) -> tuple[object, object]:
    """init_process_group for this rank -> (collective group, control group). On CPU both are the default gloo
    group; on CUDA the collectives run on NCCL and the control messages on a gloo group beside it."""
    device = launch.rank_device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = IDLE_TIMEOUT if launch.backend == "gloo" else COLLECTIVE_TIMEOUT
    dist.init_process_group(launch.backend, init_method=f"tcp://127.0.0.1:{launch.port}", rank=rank,
                            world_size=launch.world_size, timeout=timeout)
    if launch.backend == "gloo":
        return None, None
    return None, dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def receive(control: object) -> object:
    box: list[object] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def worker_main(rank: int, launch: TPLaunch) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the server's drain decides when ranks stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=launch.log_level, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    _exit_with_parent(os.getppid())
    if launch.num_threads:
        torch.set_num_threads(launch.num_threads)
    from specserve.server.engine.model_runner import ModelRunner, StepBatch
    from specserve.server.models.attention import build_attention_metadata
    from specserve.server.models.parallel_layers import TPGroup
    from specserve.server.models.shard_loader import load_sharded_model

    group, control = join_group(launch, rank)
    device, dtype = launch.rank_device(rank), getattr(torch, launch.dtype)
    model = load_sharded_model(launch.model_dir, launch.model_config, TPGroup(rank, launch.world_size, group),
                               dtype, device, launch.seed)
    runner = None
    try:
        while not isinstance(msg := receive(control), StopCall):
            if isinstance(msg, KVCall):
                runner = ModelRunner(model, model.config, msg.num_blocks, msg.block_size, dtype, device)
            elif isinstance(msg, TimeCall):
                runner.time_verify_step(msg.num_seqs, msg.query_len, msg.context_len, msg.reps)
            elif isinstance(msg, StepCall):
                runner.aux_layer_ids = msg.aux_layer_ids
                attn = build_attention_metadata(msg.query_lens, msg.seq_lens, msg.block_tables,
                                                runner.block_size, device)
                ids = torch.tensor(msg.input_ids, dtype=torch.long, device=device)
                rows = torch.tensor(msg.logits_indices, dtype=torch.long, device=device)
                runner.execute(StepBatch(ids, attn, rows, [], [], [], [], msg.query_lens))
    except RuntimeError as exc:        # a collective failed: rank 0 or a peer is gone; nothing is left to do
        log.warning("tensor-parallel rank %d stops: %s", rank, exc)
        os._exit(1)
    dist.destroy_process_group()


def _exit_with_parent(parent: int) -> None:
    """A rank whose parent (the engine) died, even by SIGKILL, must not linger holding memory or a GPU."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)
    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()
