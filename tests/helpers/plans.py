"""Deliberately wrong communication plans, for the checks that must catch them."""

from __future__ import annotations

import dataclasses

from zerotrain.parallel.pipeline.messages import Channel
from zerotrain.parallel.pipeline.plan import CommPlan, Exchange, PlanItem, Transfer


def delay_activation_send(plan: CommPlan, rank: int, micro: int) -> CommPlan:
    """``plan`` with ``rank``'s send of micro-batch ``micro``'s activations taken out of its
    exchange and posted alone just after the send of micro-batch ``micro + 1``'s: both
    exist by then, so the rank can run it, but its peer receives them in the other order."""

    def is_send(t: Transfer, m: int) -> bool:
        return (
            t.kind == "send" and t.message.channel is Channel.ACTIVATIONS and t.message.micro == m
        )

    items: list[PlanItem] = []
    moved: Transfer | None = None
    for item in plan.items[rank]:
        if isinstance(item, Exchange) and moved is None:
            found = [t for t in item.transfers if is_send(t, micro)]
            if found:
                moved = found[0]
                rest = tuple(t for t in item.transfers if t is not moved)
                if rest:
                    items.append(Exchange(item.time, rest))
                continue
        items.append(item)
        delayed_past = isinstance(item, Exchange) and any(
            is_send(t, micro + 1) for t in item.transfers
        )
        if moved is not None and delayed_past:
            items.append(Exchange(item.time, (moved,)))
    count = sum(len(i.transfers) for i in items if isinstance(i, Exchange))
    if moved is None or count != sum(len(e.transfers) for e in plan.exchanges(rank)):
        raise ValueError(f"rank {rank} sends no activations of micro-batches {micro}, {micro + 1}")
    rows = list(plan.items)
    rows[rank] = tuple(items)
    return dataclasses.replace(plan, items=tuple(rows))
