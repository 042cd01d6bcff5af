"""The two token dispatchers of expert parallelism, priced per MoE layer and training step.

Experts split over an expert-parallel group of `ep` ranks (E/ep each) that also splits the
tokens (experts on the data axis: `tokens` per rank). Forward and backward of one layer:

| dispatcher | collectives (per layer, forward + backward) | elements each rank sends |
|---|---|---|
| all-gather | all-gather of the routing (t·k ids); all-gather of the tokens and reduce-scatter of the output, forward; the same two on the gradients, backward | (ep-1)·t·H per token collective |
| all-to-all | all-to-all of the counts (E numbers); all-to-all of the routed rows and back, forward; the same two on the gradients, backward | (ep-1)/ep·t·k·H per row collective |

So the all-to-all dispatcher sends k/ep of what the all-gather one does in its row collectives
(routing spread evenly) and pays one more message round for the counts. `imbalance` >= 1 is
how many times the mean the busiest rank receives: the all-to-all's rows wait for that rank,
the all-gather's static shapes do not. Times are the alpha-beta ring model of
`autopar.cost.formulas.collective_time`, bytes its volume (comm_volumes.md); compute (the experts'
matmuls) is the same for both and not counted here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.core.errors import AutoparError
from autopar.cost.formulas import VOLUME_FACTOR, collective_time
from autopar.cost.hardware import Link

DISPATCHERS = ("all_gather", "all_to_all")
# How many times the mean number of routed rows the busiest expert receives, which the planners
# charge to the busiest rank of an expert split (`planning.ring_cost.routed_exchange_cost`): the
# all-to-all's row exchanges wait for the rank receiving the most rows, and every rank's step waits
# for the one with the most expert matmuls. An expert's excess is taken as its rank's: an upper
# bound where a rank holds several experts. Two published figures, by how the router balances:
#
# - Routers trained with an auxiliary balancing loss (Mixtral, Qwen3-MoE, OLMoE, ...): Wang, Gao,
#   Zhao, Sun, Dai, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts" (arXiv
#   2408.15664), Table 2: a 3B-parameter DeepSeekMoE model (64 experts, top 6, 200B tokens)
#   trained with the auxiliary loss keeps its busiest expert at MaxVio_global = 0.52 above the
#   mean load (0.72 for the 1B model on 100B tokens).
# - Routers with auxiliary-loss-free bias balancing (a per-expert bias added to the scores for the
#   top-k choice only, updated from each batch's load: DeepSeek-V3's, transformers'
#   `e_score_correction_bias`): the same table, Loss-Free Balancing on the 3B model,
#   MaxVio_global = 0.04. DeepSeek-V3's report (arXiv 2412.19437, 2.1.2) adopts this strategy.
#
# The paper, its authors, its 1B/100B-token and 3B/200B-token DeepSeekMoE runs and its MaxVio
# metric were found again through the stored public pages (pith.science and paperium.net
# summaries of arXiv 2408.15664); the table's numbers themselves were not in the stored corpus,
# so the figures above are as read from the paper, not re-checked there.
ROUTING_IMBALANCE = 1.52  # auxiliary-loss routers: 1 + MaxVio_global 0.52 (arXiv 2408.15664, Table 2, 3B)
LOSS_FREE_ROUTING_IMBALANCE = 1.04  # bias-balanced routers: 1 + MaxVio_global 0.04 (ibid., Loss-Free, 3B)
# The buffer transformers' bias-balanced routers keep the per-expert bias in (DeepSeek-V3, dots1,
# Kimi-Linear, ...): its presence says the router balances without an auxiliary loss.
LOSS_FREE_BIAS = "e_score_correction_bias"


def routing_imbalance(model: torch.nn.Module) -> float:
    """The busiest expert's load over the mean that planning charges `model`'s expert splits:
    `LOSS_FREE_ROUTING_IMBALANCE` where its routers balance by a score-correction bias
    (`LOSS_FREE_BIAS`, a buffer or parameter anywhere in the model), else `ROUTING_IMBALANCE`,
    the auxiliary-loss figure. The model's code says which balancing its training uses; a router
    with neither (no balancing at all) would be worse than either figure, and is not told apart."""
    named = [*model.named_buffers(), *model.named_parameters()]
    if any(name.rsplit(".", 1)[-1] == LOSS_FREE_BIAS for name, _ in named):
        return LOSS_FREE_ROUTING_IMBALANCE
    return ROUTING_IMBALANCE


# The all-to-all dispatcher as compiled plans run it (`autopar.rules.routed_experts`: the layer is
# one op per phase, nothing of run-time shape saved between them): per phase, the width of each
# row exchange in hidden sizes per routed pair. Forward: the token rows out, the experts' results
# back; backward: each pair's token row and output gradient out, the token's gradient and the
# pair's output back. Each phase also exchanges the counts (E numbers per rank) first.
PLANNED_EXCHANGES = {"forward": (1, 1), "backward": (2, 2)}


@dataclass(frozen=True)
class DispatchCost:
    """One MoE layer's token traffic for one training step on one rank."""

    dispatcher: str
    seconds: float
    bytes_sent: float
    collectives: tuple[str, ...]  # in issue order, forward then backward


def dispatch_cost(
    dispatcher: str,
    tokens: int,
    hidden: int,
    top_k: int,
    experts: int,
    ep: int,
    link: Link,
    dtype: torch.dtype = torch.float32,
    imbalance: float = 1.0,
    planned: bool = False,
) -> DispatchCost:
    """Seconds and bytes per rank of one MoE layer's dispatch and combine, forward and backward,
    with `tokens` tokens per rank of `hidden` values routed top-`top_k` over `experts` experts.
    `planned`: the all-to-all as compiled plans run it (`PLANNED_EXCHANGES`: counts once per
    phase, wider rows in backward) rather than as the runtime library does."""
    if dispatcher not in DISPATCHERS:
        raise AutoparError(
            f"no token dispatcher {dispatcher!r}",
            op="dispatch_cost",
            hint=f"use one of {', '.join(DISPATCHERS)}",
        )
    ids = torch.int64
    if dispatcher == "all_gather":
        rows = float(tokens * ep * hidden)  # the gathered tokens, the full input of the reduce-scatter
        calls = [
            ("all_gather", float(tokens * ep * top_k), ids),
            ("all_gather", rows, dtype),
            ("reduce_scatter", rows, dtype),
            ("all_gather", rows, dtype),
            ("reduce_scatter", rows, dtype),
        ]
    else:
        routed = float(tokens * top_k * hidden) * imbalance  # the rows the busiest rank exchanges
        if planned:
            calls = [
                call
                for phase in ("forward", "backward")
                for call in [
                    ("all_to_all", float(experts), ids),
                    *[("all_to_all", routed * width, dtype) for width in PLANNED_EXCHANGES[phase]],
                ]
            ]
        else:
            calls = [("all_to_all", float(experts), ids), *[("all_to_all", routed, dtype)] * 4]
    seconds = sum(collective_time(kind, n, dt, ep, link) for kind, n, dt in calls)
    sent = sum(
        VOLUME_FACTOR[kind] * (ep - 1) / ep * n * torch.empty((), dtype=dt).element_size() for kind, n, dt in calls
    )
    return DispatchCost(dispatcher, seconds, sent if ep > 1 else 0.0, tuple(kind for kind, _, _ in calls))
