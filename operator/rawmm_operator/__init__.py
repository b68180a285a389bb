"""The rawmm Kubernetes operator: RLRun custom resources -> engines, orchestrator and trainer.

Imports only `rawmm.config` (and `rawmm.quantity`) from rawmm: never engine or trainer code.
"""
