"""Update rules as functions on lists of same-shape tensors and their stacked batches.

No optimizer state objects and no communication here: each function takes the parameter views,
gradients and state views of one megabatch plus plain hyperparameters, and updates them in place.
"""

from orthoptim.rules.adamw import adamw_update
from orthoptim.rules.dion import dion_update, low_rank_factors
from orthoptim.rules.dion2 import dion2_update
from orthoptim.rules.dion3 import dion3_update
from orthoptim.rules.lion import lion_update
from orthoptim.rules.lr_scale import ADJUST_LR_MODES, lr_scale
from orthoptim.rules.muon import muon_update
from orthoptim.rules.normuon import normuon_update

__all__ = [
    "ADJUST_LR_MODES",
    "adamw_update",
    "dion2_update",
    "dion3_update",
    "dion_update",
    "lion_update",
    "low_rank_factors",
    "lr_scale",
    "muon_update",
    "normuon_update",
]
