"""The Optimizer classes: param groups, state, and the step that feeds the rules."""

from orthoptim.optim.base import NonFiniteGradientError, OrthonormalOptimizer
from orthoptim.optim.capture import CapturedStep, HostSyncCounter
from orthoptim.optim.optimizers import Dion, Dion2, Dion3, Muon, NorMuon

__all__ = ["CapturedStep", "Dion", "Dion2", "Dion3", "HostSyncCounter", "Muon", "NonFiniteGradientError", "NorMuon",
           "OrthonormalOptimizer"]
