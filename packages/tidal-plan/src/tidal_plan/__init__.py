"""tidal-plan: measure the machine, census the model, plan where every byte lives — or refuse with numbers."""

from tidal_plan.__about__ import __version__
from tidal_plan.census import BlockCensus, ModelCensus, census
from tidal_plan.config import FORMATS, PlanConfig
from tidal_plan.errors import InfeasiblePlan, PlanConfigError, PlanError
from tidal_plan.hardware import UNLIMITED, HardwareProfile, profile_hardware
from tidal_plan.plan_types import BlockPlan, OptimizerPlan, Plan, StepPrediction, compare_prediction
from tidal_plan.planner import plan
from tidal_plan.predict import predict
from tidal_plan.stream_schedule import spread_streamed, streamed_ahead
from tidal_plan.units import format_bytes, parse_bytes

__all__ = [
    "FORMATS",
    "UNLIMITED",
    "BlockCensus",
    "BlockPlan",
    "HardwareProfile",
    "InfeasiblePlan",
    "ModelCensus",
    "OptimizerPlan",
    "Plan",
    "PlanConfig",
    "PlanConfigError",
    "PlanError",
    "StepPrediction",
    "__version__",
    "census",
    "compare_prediction",
    "format_bytes",
    "parse_bytes",
    "plan",
    "predict",
    "profile_hardware",
    "spread_streamed",
    "streamed_ahead",
]
