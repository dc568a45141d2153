"""The Optimizer classes: param groups, state, and the step that feeds the rules."""

from orthoptim.optim.base import NonFiniteGradientError, OrthonormalOptimizer
from orthoptim.optim.optimizers import Dion, Dion2, Dion3, Muon, NorMuon

__all__ = ["Dion", "Dion2", "Dion3", "Muon", "NonFiniteGradientError", "NorMuon", "OrthonormalOptimizer"]
