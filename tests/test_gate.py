"""The sandbox gate's rule for a change that ends long calls: no call starts once the change is
under way, so what ``before_wait`` ended stays ended while the change waits."""

from __future__ import annotations

import asyncio

from fanfold.engine.gate import Gate


async def test_a_change_ends_long_calls_before_it_waits_and_holds_new_ones_off():
    gate = Gate()
    in_call, release, order = asyncio.Event(), asyncio.Event(), []

    async def long_call() -> None:
        async with gate.call():
            in_call.set()
            await release.wait()  # a call that would never end by itself
            order.append("long call ended")

    async def late_call() -> None:
        async with gate.call():
            order.append("late call ran")

    running = asyncio.create_task(long_call())
    await in_call.wait()
    late: list[asyncio.Task[None]] = []

    async def end_long_calls() -> None:
        late.append(asyncio.create_task(late_call()))  # arrives while the change is under way
        while not gate._cond._waiters:  # until it waits at the gate
            await asyncio.sleep(0)
        release.set()
        await running

    async with gate.change(end_long_calls):
        order.append("changed")
    await late[0]
    assert order == ["long call ended", "changed", "late call ran"]
