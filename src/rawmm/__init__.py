"""rawmm: multimodal RL with raw image offload — images travel as small content-addressed refs."""

__version__ = "0.1.0"
