"""The run configuration: one pydantic model every process and the operator read (`run_config`), and the
value types it parses with (byte sizes, durations), the engines' command line and model-path checks."""

from __future__ import annotations

from rawmm.config.run_config import BUILTIN_ENVIRONMENTS as BUILTIN_ENVIRONMENTS
from rawmm.config.run_config import ENVIRONMENT_REFERENCE_PATTERN as ENVIRONMENT_REFERENCE_PATTERN
from rawmm.config.run_config import MIN_TEMPERATURE as MIN_TEMPERATURE
from rawmm.config.run_config import RUN_SEED_LIMIT as RUN_SEED_LIMIT
from rawmm.config.run_config import ConfigError as ConfigError
from rawmm.config.run_config import EngineKind as EngineKind
from rawmm.config.run_config import EnvironmentConfig as EnvironmentConfig
from rawmm.config.run_config import InferenceConfig as InferenceConfig
from rawmm.config.run_config import InferenceSettings as InferenceSettings
from rawmm.config.run_config import MissingImagePolicy as MissingImagePolicy
from rawmm.config.run_config import ModelConfig as ModelConfig
from rawmm.config.run_config import ModelSettings as ModelSettings
from rawmm.config.run_config import MonitoringConfig as MonitoringConfig
from rawmm.config.run_config import OffloadConfig as OffloadConfig
from rawmm.config.run_config import OrchestratorConfig as OrchestratorConfig
from rawmm.config.run_config import RetentionConfig as RetentionConfig
from rawmm.config.run_config import RunConfig as RunConfig
from rawmm.config.run_config import SamplingConfig as SamplingConfig
from rawmm.config.run_config import StrictModel as StrictModel
from rawmm.config.run_config import TrainerConfig as TrainerConfig
from rawmm.config.run_config import UniqueKeyLoader as UniqueKeyLoader
from rawmm.config.run_config import environment_name_problem as environment_name_problem
from rawmm.config.run_config import format_validation_error as format_validation_error
from rawmm.config.run_config import temperature_problem as temperature_problem
from rawmm.config.run_config import yaml_error_line as yaml_error_line
