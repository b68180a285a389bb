"""The engine API's bodies live in `rawmm.contract.engine_api`, the one schema the server and the orchestrator's
client share; the engines take its `Sampling` as their sampling parameters, by this name."""

from rawmm.contract.engine_api import Sampling

__all__ = ["Sampling"]
