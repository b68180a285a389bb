"""WeightsGate: in-flight generations finish on the old weights; an update runs alone; failures keep the version."""

from __future__ import annotations

import asyncio

import pytest

from rawmm.serving.engine import WeightsGate

WAIT = 5.0


async def test_an_update_waits_for_in_flight_generations_and_holds_back_new_ones() -> None:
    gate = WeightsGate()
    events: list[str] = []
    release_first = asyncio.Event()
    first_entered = asyncio.Event()

    async def generation(name: str, release: asyncio.Event | None = None) -> int:
        async with gate.generating() as version:
            events.append(f"{name} starts on v{version}")
            if release is not None:
                first_entered.set()
                await release.wait()
            events.append(f"{name} ends")
            return version

    async def update() -> None:
        async with gate.updating():
            events.append("update")

    first = asyncio.create_task(generation("first", release_first))
    await asyncio.wait_for(first_entered.wait(), WAIT)
    # Requested in this order while the first generation runs (tasks start in the order they are made);
    # neither may get in before it ends, and the second generation must wait for the update.
    updating = asyncio.create_task(update())
    second = asyncio.create_task(generation("second"))
    release_first.set()
    versions = await asyncio.wait_for(asyncio.gather(first, second), WAIT)
    await updating
    assert versions == [0, 1]
    assert events == ["first starts on v0", "first ends", "update", "second starts on v1", "second ends"]
    assert gate.version == 1


async def test_a_failed_update_keeps_the_version_and_reopens_the_gate() -> None:
    gate = WeightsGate()
    with pytest.raises(RuntimeError):
        async with gate.updating():
            raise RuntimeError("bad checkpoint")
    assert gate.version == 0
    async with gate.generating() as version:
        assert version == 0


async def test_generations_run_together() -> None:
    gate = WeightsGate()
    both_inside = asyncio.Barrier(2)

    async def generation() -> None:
        async with gate.generating():
            await both_inside.wait()

    await asyncio.wait_for(asyncio.gather(generation(), generation()), WAIT)
