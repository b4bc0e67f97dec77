"""eqfit: typed, compiled training for Equinox models."""

from . import (
    callbacks as callbacks,
    losses as losses,
    metrics as metrics,
    models as models,
    sharding as sharding,
)
from ._checkpoint import CheckpointError as CheckpointError
from ._compile import (
    clear_cache as clear_cache,
    enable_compilation_cache as enable_compilation_cache,
)
from ._early_stopping import EarlyStopping as EarlyStopping
from ._execution import (
    Execution as Execution,
    PerStep as PerStep,
    WholeRun as WholeRun,
)
from ._fit import fit as fit, plan as plan
from ._history import History as History
from ._mean import Mean as Mean
from ._observers import Callback as Callback, ModelCallback as ModelCallback
from ._plan import (
    ArgumentBytes as ArgumentBytes,
    ArrayPlan as ArrayPlan,
    Memory as Memory,
    Plan as Plan,
)
from ._policy import Checkpoint as Checkpoint, Profile as Profile
from ._precision import Precision as Precision
from ._predict import evaluate as evaluate, predict as predict
from ._result import (
    FitResult as FitResult,
    load as load,
    NonFiniteLossError as NonFiniteLossError,
    save as save,
    TrainingInterrupted as TrainingInterrupted,
)
from ._typing import ModelState as ModelState, OptState as OptState
from ._updates import (
    AbstractUpdate as AbstractUpdate,
    Applied as Applied,
    Update as Update,
)
from ._validation import ValidationSets as ValidationSets
from ._version import __version__ as __version__
