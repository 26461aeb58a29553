"""Logprobs of emitted tokens, from the RAW target distribution (vLLM v1's default "raw" mode).

Raw means log_softmax of the unprocessed logits row that produced the token: no penalties, bias,
temperature or truncation. That row is the same whether the token came out of plain decoding or was
an accepted draft (row j of a verification batch sees exactly the history plain decoding would
have), so both report identical values for the same token.

Worked example: raw row [0, ln 3] -> log_softmax [ln 0.25, ln 0.75]; emitting token 0 with
logprobs = 1 gives TokenLogprob(0, ln 0.25, top=[(1, ln 0.75)]).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.sampling.outputs import TokenLogprob


def collect_logprobs(target_logits: torch.Tensor,  # [num_rows, vocab] raw
                     rows: Sequence[int],           # [M] the row that emitted each token
                     token_ids: Sequence[int],      # [M] the emitted tokens
                     num_top: Sequence[int],        # [M] top-N alternatives wanted per token
                     ) -> list[TokenLogprob]:
    if not rows:
        return []
    device = target_logits.device
    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    # float32 even for half-precision logits: logprobs near 0 need the mantissa.
    logprobs = torch.log_softmax(target_logits.index_select(0, row_index).float(), dim=-1)  # [M, vocab]
    token_index = torch.tensor(token_ids, dtype=torch.long, device=device)
    chosen = logprobs.gather(1, token_index[:, None]).squeeze(1).tolist()              # [M]
    max_top = min(max(num_top), logprobs.shape[1])
    if max_top > 0:
        top = logprobs.topk(max_top, dim=-1)                                          # [M, max_top]
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    out = []
    for m, (token_id, logprob, n) in enumerate(zip(token_ids, chosen, num_top)):
        alternatives = list(zip(top_ids[m][:n], top_values[m][:n])) if n > 0 and max_top > 0 else []
        out.append(TokenLogprob(token_id=token_id, logprob=logprob, top=alternatives))
    return out
