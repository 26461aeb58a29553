"""SamplingBatch: where each request's rows sit in one verification batch, built once per step.

The verification forward returns a ragged stack of logits rows: request i owns k_i + 1 consecutive
rows, row j being the target's next-token scores after prompt + output + drafts[:j]. Every stage of
sampling (penalties, bias, truncation, acceptance) needs to map between requests and rows; this file
does that bookkeeping once, with tensors, so the stages themselves carry no per-row Python.

Worked example: three requests with k = [2, 0, 1] occupy 5 rows

    row:       0  1  2 | 3 | 4  5
    request:   0  0  0 | 1 | 2  2
    row_pos j: 0  1  2 | 0 | 0  1        (j = how many drafts precede the row)

and the group of requests [0, 2] (say, the random-sampling ones) is rows [0, 1, 2, 4, 5] with
local_req = [0, 0, 0, 1, 1] and local_start = [0, 3].
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.sampling.outputs import SeqSamplingInput
from specserve.sampling.params import SamplingParams


def is_greedy(params: SamplingParams) -> bool:
    return params.greedy     # the one rule: SamplingParams.greedy (temperature < GREEDY_TEMPERATURE)


def _exclusive_cumsum(values: Sequence[int]) -> list[int]:
    return [0, *itertools.accumulate(values)][:-1]


@dataclass
class RowGroup:
    """A subset of the batch's requests together with all of their rows, in batch order."""
    reqs: list[int]                 # request indices (into SamplingBatch.seqs), ascending
    req_index: torch.Tensor         # [m] long, `reqs` on the device
    rows: torch.Tensor              # [rows_m] long, global row of each member row
    local_req: torch.Tensor         # [rows_m] long, position in `reqs` of the row's request
    row_pos: torch.Tensor           # [rows_m] long, j = number of drafts preceding the row
    local_start: torch.Tensor       # [m] long, index into `rows` of each request's first row
    num_drafts: torch.Tensor        # [m] long, k of each member request
    covers_batch: bool              # every row of the batch, in order: callers may skip index_select

    def __len__(self) -> int:
        return len(self.reqs)

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]


@dataclass
class SamplingBatch:
    seqs: list[SeqSamplingInput]
    vocab_size: int
    device: torch.device
    num_drafts: list[int]           # k_i per request
    row_start: list[int]            # first global row of each request
    num_rows: int                   # sum_i (k_i + 1)
    max_drafts: int                 # max_i k_i (0 when nobody speculates)
    draft_ids: torch.Tensor         # [n, max_drafts] long; entries at j >= k_i are padding (0)
    greedy: RowGroup                # requests decoded by argmax
    random: RowGroup                # requests sampled from target_probs

    @classmethod
    def build(cls, seqs: Sequence[SeqSamplingInput],
              target_logits: torch.Tensor,  # [num_rows, vocab]
              ) -> SamplingBatch:
        seqs = list(seqs)
        num_drafts = [len(s.draft_token_ids) for s in seqs]
        num_rows = sum(num_drafts) + len(seqs)
        if target_logits.dim() != 2 or target_logits.shape[0] != num_rows:
            raise ValueError(f"target_logits must be [sum(k_i + 1) = {num_rows}, vocab], "
                             f"got {tuple(target_logits.shape)}")
        device = target_logits.device
        max_drafts = max(num_drafts, default=0)
        batch = cls(seqs=seqs, vocab_size=target_logits.shape[1], device=device,
                    num_drafts=num_drafts, row_start=_exclusive_cumsum([k + 1 for k in num_drafts]),
                    num_rows=num_rows, max_drafts=max_drafts, draft_ids=None,
                    greedy=None, random=None)  # type: ignore[arg-type]  # filled just below
        batch.draft_ids = batch._padded_drafts()
        greedy_flags = [is_greedy(s.params) for s in seqs]
        batch.greedy = batch.group([i for i, g in enumerate(greedy_flags) if g])
        batch.random = batch.group([i for i, g in enumerate(greedy_flags) if not g])
        return batch

    def _padded_drafts(self) -> torch.Tensor:
        """[n, max_drafts] long. Built from one flat list: a nested list is much slower to convert."""
        draft_ids = torch.zeros(len(self.seqs), self.max_drafts, dtype=torch.long, device=self.device)
        if self.max_drafts:
            flat = self._long(list(itertools.chain.from_iterable(s.draft_token_ids for s in self.seqs)))
            entry_of, _, position = self.entry_rows(range(len(self.seqs)), self.num_drafts)
            draft_ids[entry_of, position] = flat
        return draft_ids

    def _long(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def group(self, reqs: list[int]) -> RowGroup:
        """All rows of the requests `reqs` (ascending), with their local bookkeeping."""
        nrows = [self.num_drafts[i] + 1 for i in reqs]
        entry_of, rows, row_pos = self.entry_rows(reqs, nrows)
        return RowGroup(reqs=reqs, req_index=self._long(reqs), rows=rows, local_req=entry_of,
                        row_pos=row_pos, local_start=self._long(_exclusive_cumsum(nrows)),
                        num_drafts=self._long([n - 1 for n in nrows]),
                        covers_batch=len(reqs) == len(self.seqs))

    def entry_rows(self, entry_req: Sequence[int], entry_nrows: Sequence[int],
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expand per-request entries onto the first entry_nrows[e] rows of request entry_req[e].

        Used for anything a request attaches to its rows (a logit_bias entry, a banned stop id).
        Example: entries on requests [0, 2] with nrows [3, 1] in the module example give
        entry_of = [0, 0, 0, 1], rows = [0, 1, 2, 4], row_pos = [0, 1, 2, 0].

        Returns entry_of [M] (index of the entry), rows [M] (global row), row_pos [M] (j of the row).
        """
        return self._expand([self.row_start[r] for r in entry_req], entry_nrows)

    def member_rows(self, group: RowGroup, members: Sequence[int],
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of some members of `group`, as indices into the group's own rows.

        Example: in the module example's group [0, 2], members [1] (request 2) give local rows
        [3, 4] and member_of_row [0, 0] (the position in `members` of each row's request).
        """
        group_first = _exclusive_cumsum([self.num_drafts[i] + 1 for i in group.reqs])
        member_of_row, local_rows, _ = self._expand(
            [group_first[m] for m in members], [self.num_drafts[group.reqs[m]] + 1 for m in members])
        return local_rows, member_of_row

    def _expand(self, starts: Sequence[int], nrows: Sequence[int],
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """entry_of [M], rows [M] = starts[e] + offset, offset [M], for nrows[e] rows per entry e."""
        total = sum(nrows)
        entry_of = torch.repeat_interleave(
            torch.arange(len(nrows), device=self.device), self._long(nrows), output_size=total)
        first = self._long(_exclusive_cumsum(nrows))                          # [E]
        offset = torch.arange(total, device=self.device) - first[entry_of]   # [M]
        return entry_of, self._long(starts)[entry_of] + offset, offset

    def per_row(self, values: Sequence[float], owner_of_row: torch.Tensor,  # [rows] long
                dtype: torch.dtype) -> torch.Tensor:
        """[rows]: one scalar per owner (request or entry) broadcast to the owner's rows."""
        return torch.tensor(values, dtype=dtype, device=self.device)[owner_of_row]

    def per_request(self, group: RowGroup, values: Sequence[float], dtype: torch.dtype,
                    ) -> torch.Tensor:
        """[group.num_rows]: one scalar per member of `group` broadcast to the group's rows."""
        return self.per_row(values, group.local_req, dtype)
