"""The rawmm kopf operator: RLRun custom resources in, the running stack out."""
