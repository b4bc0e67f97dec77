"""eqfit: typed, compiled training for Equinox models."""

from . import losses as losses, models as models
from ._fit import fit as fit, FitResult as FitResult
from ._history import History as History


__version__ = "0.1.0"
