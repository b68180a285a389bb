"""The raw-ref serving extension: HTTP routes, the transformers CPU engine, the vLLM integration."""
