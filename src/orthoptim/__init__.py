"""orthoptim: orthonormal optimizers for PyTorch (Dion3, Dion, Dion2, Muon, NorMuon).

    import orthoptim
    opt = orthoptim.Dion3(orthoptim.param_groups(model), lr=0.01)
    print(orthoptim.explain(opt))
"""

from orthoptim.grouping import describe_assignment, explain, param_groups
from orthoptim.optim import (
    CapturedStep,
    Dion,
    Dion2,
    Dion3,
    HostSyncCounter,
    Muon,
    NonFiniteGradientError,
    NorMuon,
    OrthonormalOptimizer,
)
from orthoptim.orthogonalize import gram_newton_schulz, newton_schulz, svd_polar

__version__ = "0.1.0"

__all__ = [
    "CapturedStep",
    "Dion",
    "Dion2",
    "Dion3",
    "HostSyncCounter",
    "Muon",
    "NonFiniteGradientError",
    "NorMuon",
    "OrthonormalOptimizer",
    "__version__",
    "describe_assignment",
    "explain",
    "gram_newton_schulz",
    "newton_schulz",
    "param_groups",
    "svd_polar",
]
