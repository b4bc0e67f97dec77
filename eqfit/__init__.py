"""eqfit: typed, compiled training for Equinox models."""

from . import (
    callbacks as callbacks,
    losses as losses,
    metrics as metrics,
    models as models,
    sharding as sharding,
)
from ._buckets import Buckets as Buckets
from ._core._auto_microbatches import AutoMicrobatches as AutoMicrobatches
from ._core._early_stopping import EarlyStopping as EarlyStopping
from ._core._execution import (
    Execution as Execution,
    PerStep as PerStep,
    WholeRun as WholeRun,
)
from ._core._policy import Checkpoint as Checkpoint, Profile as Profile
from ._core._typing import ModelState as ModelState, OptState as OptState
from ._core._version import __version__ as __version__
from ._evaluate import evaluate as evaluate
from ._fit import fit as fit, plan as plan
from ._history import History as History, NonFinite as NonFinite
from ._host._observers import Callback as Callback, ModelCallback as ModelCallback
from ._host._plan import (
    ArgumentBytes as ArgumentBytes,
    ArrayPlan as ArrayPlan,
    Memory as Memory,
    Plan as Plan,
)
from ._keep._directory import CheckpointError as CheckpointError
from ._keep._writer import wait_for_checkpoints as wait_for_checkpoints
from ._predict import predict as predict
from ._program._compile import (
    clear_cache as clear_cache,
    enable_compilation_cache as enable_compilation_cache,
)
from ._result import (
    FitResult as FitResult,
    NonFiniteLossError as NonFiniteLossError,
    TrainingInterrupted as TrainingInterrupted,
)
from ._save import load as load, save as save
from ._step._mean import Mean as Mean
from ._step._precision import Precision as Precision
from ._step._updates import (
    AbstractUpdate as AbstractUpdate,
    Applied as Applied,
    Update as Update,
)
from ._step._validation import ValidationSets as ValidationSets
