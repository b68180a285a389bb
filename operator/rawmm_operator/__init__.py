"""The rawmm Kubernetes operator: RLRun custom resources -> engines, orchestrator and trainer.

Imports only the `rawmm.config` package from rawmm: never engine or trainer code.
"""
