"""eqfit: typed, compiled training for Equinox models."""

from . import losses as losses, metrics as metrics, models as models
from ._early_stopping import EarlyStopping as EarlyStopping
from ._fit import (
    Callback as Callback,
    fit as fit,
    FitResult as FitResult,
    NonFiniteLossError as NonFiniteLossError,
)
from ._history import History as History
from ._predict import evaluate as evaluate, predict as predict


__version__ = "0.1.0"
