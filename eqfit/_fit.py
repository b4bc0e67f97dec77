"""The public `fit`, read as its phases: check, open, build, compile and drive, finish.

Each phase is a module of its own, in the layers `CONTRIBUTING.md` maps; data flows one
way through them.
"""

import contextlib
import contextvars
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import equinox as eqx
from jax.sharding import Mesh

from ._core._auto_microbatches import AutoMicrobatches
from ._core._checks import checked, takes_arguments_of
from ._core._early_stopping import EarlyStopping
from ._core._execution import Execution
from ._core._policy import Checkpoint, PREEMPTION_SIGNALS, Profile
from ._core._typing import (
    Data,
    FilterSpec,
    Flag,
    Integer,
    Loss,
    Metrics,
    Model,
    ModelState,
    Number,
    Optimizer,
    OptState,
    PathLike,
    PRNGKey,
    Schedules,
)
from ._host._observers import Callback
from ._host._plan import Plan
from ._host._planner import step_costs
from ._host._signals import Interrupt
from ._keep._keeping import Keeping
from ._program._options import check_options
from ._program._parallel import Device
from ._program._sharding import Shard
from ._result import FitResult
from ._step._precision import PrecisionLike
from ._step._remat import REMAT_VALUES, RematLike
from ._step._updates import AbstractUpdate
from ._step._validation import ValidationSets
from ._train import choose_microbatches, open_and_build, plan_of, Ready, train
from .metrics import _taken


@checked(
    "fit",
    {
        "key": "a single PRNG key such as `jax.random.key(0)`",
        "profile": "an `eqfit.Profile(directory, start_step, steps)`",
        "progress": "True, False, 'bar' or 'lines'",
        "on_nan": "'raise', 'stop' or 'skip'",
        **{
            name: "a whole number (a Python int or a numpy integer)"
            for name in (
                "epochs initial_epoch steps_per_epoch batch_size validation_freq "
                "validation_every log_every checkpoint_every"
            ).split()
        },
        "microbatches": (
            'a whole number (a Python int or a numpy integer), "auto" or an '
            "`eqfit.AutoMicrobatches(memory, margin)`"
        ),
        "execution": "`'auto'`, `eqfit.WholeRun()` or `eqfit.PerStep(unroll)`",
        "remat": REMAT_VALUES,
        "optimizer": (
            "one optax `GradientTransformation`, such as `optax.adam(1e-3)` (`optax.adam` "
            "itself makes one when called; to train parts of the model at once, each by an "
            "optimizer of its own, combine them with `optax.multi_transform`; for updates of "
            "several losses in turn, as a GAN's, pass `updates=[eqfit.Update(...), ...]`)"
        ),
        "loss": (
            "one function `loss(model, *batch)` returning a scalar (for several terms, "
            "return their sum, and the terms as aux values: `(total, {'kl': kl, ...})`)"
        ),
        "trains": "a function that picks parts of the model, as `lambda m: m.student`",
        "updates": (
            "a list of updates, run in turn each step: "
            "`[eqfit.Update('d', d_loss, opt_d, trains=lambda m: m.discriminator), ...]`, "
            "or `eqfit.AbstractUpdate`s of your own"
        ),
    },
)
def fit(
    model: Model,
    data: Data | None = None,
    *,
    loss: Loss | None = None,
    optimizer: Optimizer | None = None,
    key: PRNGKey,
    epochs: Integer = 1,
    batch_size: Integer | None = None,
    steps_per_epoch: Integer | None = None,
    initial_epoch: Integer = 0,
    shuffle: bool = True,
    drop_remainder: bool = False,
    progress: bool | Literal["bar", "lines"] = False,
    filter_spec: FilterSpec = eqx.is_inexact_array,
    trains: Callable[[Any], Any] | None = None,
    opt_state: OptState | None = None,
    state: ModelState | None = None,
    validation_data: Data | ValidationSets | None = None,
    validation_split: float | None = None,
    validation_freq: Integer = 1,
    validation_every: Integer | None = None,
    metrics: Metrics | None = None,
    log_every: Integer | None = None,
    early_stopping: EarlyStopping | None = None,
    on_nan: Literal["raise", "stop", "skip"] = "raise",
    callbacks: Sequence[Callback] = (),
    devices: int | Sequence[Device] | None = None,
    mesh: Mesh | None = None,
    shard: Shard | None = None,
    ensemble: bool = False,
    checkpoint: PathLike | Checkpoint | None = None,
    checkpoint_every: Integer = 1,
    signals: Sequence[str | int] | None = PREEMPTION_SIGNALS,
    precision: PrecisionLike = None,
    ema: Number | None = None,
    validate_ema: bool = False,
    norms: Flag = False,
    microbatches: Integer | Literal["auto"] | AutoMicrobatches = 1,
    remat: RematLike = None,
    schedules: Schedules | None = None,
    peak_flops: Number | None = None,
    profile: Profile | None = None,
    execution: Execution | Literal["auto"] = "auto",
    updates: Sequence[AbstractUpdate] | None = None,
) -> FitResult[Model]:
    """Trains `model` on `data` by minibatch gradient descent, compiled end to end.

    **Main arguments:**

    - `model`: any PyTree of arrays, usually an `eqx.Module`. It is not changed; the
        trained one comes back as `result.model`, of the same type.
    - `data`: the training data, any of:
        - a tuple of numpy or JAX arrays sharing their leading (sample) axis, `(x, y)`,
            unpacked into `loss(model, *batch)`; or another PyTree of such arrays (a dict,
            say), passed whole as `loss(model, batch)`. It goes to the device once; each
            pass then permutes indices, not data;
        - the same with `np.memmap` arrays (`np.load(..., mmap_mode="r")`), for data
            larger than memory: read in chunks while the device trains;
        - a loader: a re-iterable yielding batches (a PyTorch `DataLoader`, a Grain
            dataset), iterated anew for each pass; or an iterator or generator, used once
            (an endless one needs `steps_per_epoch`). A loader without `len` trains its
            first pass as it is read, and that pass's length is every epoch's (an
            iterator without `len` trains one epoch, to its end, unless given
            `steps_per_epoch`); its checkpoints keep that length, and a resumed run
            takes it and refuses a loader whose first pass is not that long;
        - `None` (the default), where the updates make their own data (a rollout in a
            JAX environment, as PureJaxRL's PPO does): with `updates=` of your own and
            `steps_per_epoch=`, each step runs every update once with `batch=None`.
    - `loss`: called as `loss(model, *batch)` (or `loss(model, state, *batch)` returning
        `(value, new_state)` with `state=`), returning a scalar. If it takes a keyword
        `key`, it gets a fresh key every step (for dropout and the like). It may also
        return what it computes besides: `(value, aux)`, `aux` a dict of scalars (or of
        arrays, averaged), such as `{"kl": kl}`; with `state=`, `((value, aux),
        new_state)`. Only `value` is differentiated; each aux value is recorded under its
        name per step and per epoch, and on the validation data as `val_<name>`.
    - `optimizer`: any optax `GradientTransformation` (or `optax.MultiSteps`). Each gets
        the extra arguments its `update` takes: the loss as `value` (read by
        `optax.contrib.reduce_on_plateau`), and `grad_fn`, the gradient at other
        parameters on the step's batch (asked for by `optax.contrib.sam(...,
        opaque_mode=True)`).
    - `key`: a PRNG key, `jax.random.key(seed)`. It drives the shuffle, the per-step keys
        and `validation_split`.
    - `epochs`: the number of the last epoch, counted from 1: how many epochs to train,
        or with `initial_epoch`, where to stop.
    - `batch_size`: samples per step; by default 32, or a loader's own.

    **Other arguments:**

    *How the data is gone through:*

    - `steps_per_epoch`: optimizer steps per epoch. By default an epoch is a pass over the
        data. Given, the data is a continuing sequence of passes (each sample once per
        pass, shuffled anew) cut into epochs of this many steps: the history, validation,
        metrics, early stopping, checkpoints, callbacks and the bar all go by it.
    - `initial_epoch`: epochs already trained, when continuing a run with its `opt_state`:
        the shuffles, per-step keys and epoch numbers go on from there, so that 5 epochs
        and then epochs 6 to 10 train as 10 epochs would. A loader's passes before
        `initial_epoch` are read and not trained on, so that it goes on where it was;
        without `len`, the first of them gives the epoch's length.
    - `shuffle`: visit the samples in a new random order each pass.
    - `drop_remainder`: skip the last, smaller batch of each pass instead of taking it
        as one more step.

    *What trains, and from where:*

    - `filter_spec`: which leaves of `model` train, as in `eqx.partition`. Leaves that
        are not floating-point arrays never train.
    - `trains`: the parts of `model` that train, picked as `eqx.tree_at`'s `where` picks
        them: `lambda m: m.student`, or `lambda m: (m.encoder, m.head)`. Every
        floating-point array inside them trains and the rest of the model is frozen (a
        teacher, a pretrained body): a `filter_spec` said by the parts' names. Give
        `trains` or a `filter_spec`, not both.
    - `opt_state`: an optimizer state to continue from, such as a previous result's.
    - `state`: the `eqx.nn.State` of a stateful model (BatchNorm and the like).
    - `updates`: instead of `loss` and `optimizer`, several updates run in turn on each
        step's batch, each on the model (and state) the one before it left: a GAN's
        discriminator and then its generator, `[eqfit.Update("d", d_loss, opt_d,
        trains=lambda m: m.discriminator), eqfit.Update("g", g_loss, opt_g, trains=lambda
        m: m.generator)]`. Each records its loss and aux values under its name (`d_loss`,
        `g_<aux>`, `val_d_loss`; `history.loss` is the sum of the losses of the updates
        that ran in the step), and keeps its optimizer's state in `result.opt_state[name]`.
        An [`eqfit.Update`][] may run on every `every`-th step only; an
        [`eqfit.AbstractUpdate`][] is an update of your own. The step's options act per
        update: `shard=` lays out each one's optimizer state, float16 scales each loss
        with its own scale (`<name>_loss_scale`), `schedules=` records each at its own
        optimizer's count (`<name>_<schedule>`); see the guide "Research training".

    *What is measured, and when to stop:*

    - `validation_data`: data like `data`'s, evaluated after each epoch in inference
        mode, recorded as `val_loss`, `val_<metric>`; or several sets, each named,
        [`eqfit.ValidationSets`][]`(clean=(x, y), noisy=(xn, yn))`, recorded as
        `val_clean_loss`, `val_noisy_<metric>`. Arrays in memory go to the device once;
        memmaps and loaders (a re-iterable one, read anew at each validation; an iterator
        or generator only where the run validates once) stream, a pass at each validated
        epoch's end, in chunks read in a background thread. A loss that requires a `key`
        gets a new one for each batch of each epoch, derived from `key`.
    - `validation_split`: instead, hold out this fraction of `data`'s samples (arrays or
        memmaps), chosen from `key`.
    - `validation_freq`: validate every this many epochs: the epochs whose number
        (counted from 1) is a multiple of it. The others have NaN for their validation
        values, and early stopping on one of these waits for the next validated epoch.
    - `validation_every`: instead, validate after every this many steps, counted from the
        first step ever across epochs (a step whose global count it divides), inside the
        compiled run. Each validation's values go to `history.validations` at its step
        (`history.validation_steps`), to the callbacks' `on_validation_end(step, logs)`
        (the loggers write them as `step/val_<name>`), and to early stopping and
        `Checkpoint(keep_best=)` where they monitor a validation value: they then judge
        each validation (early stopping's `patience` and `start_from_epoch` count
        validations). An epoch's validation values in `history.values` are its last
        validation's. Named so as `log_every` and `checkpoint_every` are: a count of steps,
        where Lightning's `val_check_interval` takes a count or a fraction of an epoch.
        More than the run's steps is refused: it would never validate.
    - `metrics`: `{name: fn}`, each `fn(model, *batch) -> scalar` (with `state=`,
        `fn(model, state, *batch)`), recorded per epoch on the training batches and on
        the validation data; or a metric that accumulates (an
        `eqfit.metrics.AbstractMetric`: `F1`, `ConfusionMatrix`, a metrax metric), whose
        statistics are summed over the epoch (or the validation set) and whose value,
        a scalar or an array, is computed once from the sum.
    - `log_every`: also tell the callbacks the training values every this many steps
        (counted from the first step ever, across epochs): each callback with
        `on_train_batch_end(step, logs)` gets, after every n-th step, the step's global
        number (its count from the first ever) and the values of the n steps before it,
        reduced as an epoch's are (the loss and metrics their mean over the samples).
        The loggers of `eqfit.callbacks` write them, so a run of one long epoch logs a
        curve. Computed inside the program at each call's end, and read with the call's
        report: no step waits for the host. More than the run's steps is refused.
    - `early_stopping`: an [`eqfit.EarlyStopping`][], carried out on the device.
    - `on_nan`: what a NaN or infinite loss does. `"raise"`: stop, and raise
        [`eqfit.NonFiniteLossError`][] holding the last finite model and what a replay of
        the step found made it so ([`eqfit.NonFinite`][]: the operation and its line,
        the parameters, the rows). `"stop"`: stop and return it, the replay's finding in
        `history.non_finite`. `"skip"`: skip that update and go on. With `norms=True`, a
        gradient that is not finite counts as such a loss. The check never syncs the
        host, and on finite losses all three train alike, bit for bit. With `"raise"`
        and `"stop"`, where the execution has no guard (`execution`'s `guard`; by
        default wherever a replay can give the same bits), the run stops after the
        non-finite step and the model before it is replayed, from the newest checkpoint
        or the start.

    *Real models:*

    - `precision`: mixed precision. `"bfloat16"`: the trained arrays, their optimizer
        state and their average stay in float32; inside each step the model's floating
        arrays and the batch's inputs (`x`; targets stay as given) are cast to bfloat16
        for the loss's forward and backward passes, and the loss and gradients come back
        in float32 (eqfit's losses take the outputs in float32). `"float16"`: the same
        in float16, with dynamic loss scaling (`history["loss_scale"]`,
        `history["skipped_steps"]`). An [`eqfit.Precision`][] sets the dtypes, the arrays
        kept in float32 and the scaling. Validation and metrics run under it too;
        `result.model` comes back in its own dtypes.
    - `ema`: keep a moving average of the trained arrays, `average = ema * average + (1
        - ema) * weights` after every step (from the initial weights, no bias
        correction), returned as `result.ema_model`, in float32 at least. With
        `optax.MultiSteps` it steps with every microbatch. A Python, numpy or JAX
        scalar. A run too short for it is warned of (Keras says nothing): one that leaves
        more than half of the average at the initial weights, `ema**steps > 0.5`.
    - `validate_ema`: validate the average instead of the weights (validation values,
        metrics and early stopping on them).
    - `norms`: record the global L2 norm of each step's gradient (unscaled, before the
        optimizer) and of its update as `"grad_norm"` and `"update_norm"`.
    - `microbatches`: compute each batch as this many microbatches of `batch_size /
        microbatches` rows, one after another, and step once on their summed gradient:
        gradient accumulation that gives the step of the whole batch (to float
        rounding), holding one microbatch's activations. Each value weighs as its rows,
        an [`eqfit.Mean`][] as its weight, so a masked token mean is the whole batch's.
        The model state (BatchNorm) passes from each microbatch to the next, and each
        gets its own key. Unlike `optax.MultiSteps` (and Keras's
        `gradient_accumulation_steps`), `batch_size` is the batch the step trains on,
        and a step is one update. `"auto"` (or an [`eqfit.AutoMicrobatches`][] with
        its own memory and margin): the fewest that fit the device's memory, as the
        compiled run's memory analysis says (it compiles each count it tries);
        `history.microbatches` holds the count, `eqfit.plan`'s `microbatches_why` why.
    - `remat`: activation checkpointing: the loss's forward pass (each microbatch's, each
        `eqfit.Update`'s unless its own `remat=` says otherwise) keeps what a
        `jax.checkpoint` policy saves, and the backward pass computes the rest again:
        `"nothing"` (`nothing_saveable`), `"dots"` (`dots_saveable`), `"dots_no_batch"`
        (`dots_with_no_batch_dims_saveable`) or a policy function. It trains as without,
        to float rounding; the FLOPs (and MFU) are the model's. Keras has no such option.
    - `schedules`: `{name: schedule}`, such as `{"learning_rate": schedule}` for
        `optax.adam(schedule)`: each step records `schedule(count)` under `name`, the
        count being the one the step's update uses (the optimizer state's first `count`
        before the update; with `optax.MultiSteps`, its `gradient_step`, the inner
        optimizer's updates so far). The hyperparameters that `optax.inject_hyperparams`
        keeps in the optimizer's state are recorded without it, by their names
        (`"learning_rate"`, `"b1"`, ...), each the value the step's update used. Per
        epoch, both are the epoch's last step's.

    *What the host sees:*

    - `progress`: `False` runs the training in a few long calls of the compiled program.
        `True` shows how the run goes, and calls the same program in shorter pieces; the
        result is the same, bit for bit. It prints the run's plan in one line
        (parameters, memory per device, FLOPs per step; see [`eqfit.plan`][]) and, as
        each epoch ends, a line of its values (`history.values`' row, and the epoch's
        time where it took a second or more). Where stderr is a terminal (or a
        notebook) a tqdm bar below them shows the running epoch's mean loss and samples
        per second, within the terminal's width. Anywhere else (a log file, a pipe, a
        batch job's output) no bar is drawn: an epoch longer than a minute adds a line
        about once a minute (the step reached, the running loss, samples per second;
        the environment variable `EQFIT_LINE_SECONDS` sets another interval), and a
        last line says how the run ended (done, stopped early, or by which signal), at
        which step, and where the newest checkpoint is. `"bar"` or `"lines"` asks for
        one of the two wherever the output goes.
    - `peak_flops`: one device's peak FLOP/s, for the model FLOPs utilisation
        (`history.throughput["mfu"]`) on a device that eqfit's table does not know. In
        FLOP/s, not TFLOP/s (`989e12`): a value below 1e9 is refused as a slip of unit.
    - `callbacks`: objects with `on_epoch_end(epoch, logs)` (epochs counted from 1), called
        on the host after each epoch; returning `True` stops training. One that also has
        `on_epoch_model(epoch, model, ema_model)` ([`eqfit.ModelCallback`][]) gets the
        model at each epoch's end, of `model`'s class, as `fit(..., epochs=epoch)` would
        return it. [`eqfit.callbacks`][] has ready ones for logs (CSV, TensorBoard, W&B,
        MLflow).
    - `profile`: an [`eqfit.Profile`][]`(directory, start_step, steps)`: those steps
        (counted from the run's first step ever) are traced with `jax.profiler` into
        `directory`, the device waited for at both ends; the results are the same, bit
        for bit.
    - `execution`: how the steps run: [`eqfit.WholeRun`][]`()`, every step inside one
        compiled loop, or [`eqfit.PerStep`][]`(unroll=1)`, programs of `unroll` steps
        with no loop in them, called one after another from Python. By default
        (`"auto"`) `fit` takes `PerStep` where XLA compiles the step worse inside a loop
        (a loss that convolves, on the CPU backend) and `WholeRun` elsewhere;
        `eqfit.plan` shows the choice and why. Validation runs as the steps do: with
        `PerStep`, each epoch's validation is programs of `unroll` batches called from
        Python too. The history, the model and the checkpoints agree between the two to
        float tolerance (only XLA's fusion differs), and a checkpoint written in one
        resumes in the other. Each takes `guard=`: whether each update sits in a
        `lax.cond` that leaves it unapplied where its loss is not finite (`on_nan`), or
        is applied whatever its loss, the state before such a step then replayed: the
        same bits on finite runs; by default none, but where a replay cannot give the
        same bits (`devices=`, a precision policy, an ensemble, a one-shot iterator,
        several processes).

    *Where it runs:*

    - `devices`: data parallel over these local devices (or the first `devices` of them)
        with `eqx.filter_pmap`. Each batch is split evenly over them, so `batch_size`
        must be a multiple of their number.
    - `mesh`: data parallel through sharding over the first axis of this
        `jax.sharding.Mesh`, which may span several processes (`jax.distributed`); then
        each process passes its own rows of `data`.
    - `shard`: with `mesh`, how each array of the model is laid out over it, so that no
        device holds the whole model and optimizer state: [`eqfit.sharding.fsdp`][] (each
        array split along its largest dimension), [`eqfit.sharding.rules`][] (regexes over
        the arrays' paths, as Keras's `LayoutMap`), a function `(path, leaf) ->
        PartitionSpec | None`, or a PyTree of `PartitionSpec | None` that is a prefix of
        the model. The optimizer state follows the parameters; `result.model` comes back
        laid out so. By default every array is replicated.
    - `ensemble`: `model` is a stack of members (every array with a leading member axis,
        as `eqx.filter_vmap` builds it), trained side by side in one program. Member `i`
        trains as it would alone with key `jax.random.split(key, members)[i]`, with its
        own slice of every array, those that do not train included. `state` and
        `opt_state`, if given, are stacked too.

    *What survives:*

    - `checkpoint`: a directory, or an [`eqfit.Checkpoint`][] policy with one (by
        epochs, steps or wall seconds; the newest `keep` kept, and the best by a value).
        The whole training state is written there atomically (in a background thread
        on a GPU or TPU, in the training thread on a CPU: the policy's `background`),
        every `checkpoint_every` epochs (or as the policy says),
        at the run's end and at the step where a signal stopped it; `fit` returns once
        the last is committed (in the background, once it is copied:
        [`eqfit.wait_for_checkpoints`][]). Calling `fit` again with the same directory resumes from
        the newest good checkpoint, inside an epoch or at its end, and ends with the
        same bits as an uninterrupted run; one written by another configuration is
        refused, as is one of other data, validation data, metrics or optimizer
        numbers (by fingerprints the checkpoint keeps), naming what differs, unless
        `eqfit.Checkpoint(directory, allow_changes=(...))` says the change is meant.
    - `checkpoint_every`: epochs between checkpoints, with a directory.
    - `signals`: the signals that stop training as Ctrl-C does, by name: a cluster's
        preemption (SLURM, Kubernetes: SIGTERM, then SIGKILL after a grace period).
        `()` leaves them to Python.

    **Returns:**

    A [`eqfit.FitResult`][] with the trained `model`, the `opt_state`, the `history`, the
    model `state`, and with `ema=` the average as `ema_model`. What the run carries (the
    arrays that train, the optimizer's and the model's state) comes back strongly typed,
    of its dtype, where it was weakly typed (Equinox's `PReLU(0.2)` holds
    `jnp.asarray(0.2)`), as a hand loop's optax update makes it: the run fixes its types
    before the first call, so that no call compiles its program again. (In a model of a
    lower precision such an array then promotes as a float32 would: give it its dtype.)

    **Raises:**

    - `TypeError`, `ValueError`: a bad argument, named, before anything is compiled.
    - [`eqfit.NonFiniteLossError`][]: a NaN or infinite loss with `on_nan="raise"`.
    - [`eqfit.TrainingInterrupted`][]: Ctrl-C or one of `signals`, which stops training
        at the end of the call of the program in flight (half a second, or a step),
        writing a checkpoint there if there is a directory. A second one stops at once.
    - [`eqfit.CheckpointError`][]: a checkpoint could not be written.

    Each of the last three holds what was trained as `.result`.
    """
    began = time.perf_counter()
    # Check: every argument, before any data is read or any program compiled.
    options = check_options(
        model=model,
        data=data,
        opt_state=opt_state,
        key=key,
        epochs=epochs,
        initial_epoch=initial_epoch,
        steps_per_epoch=steps_per_epoch,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_remainder=drop_remainder,
        progress=progress,
        on_nan=on_nan,
        state=state,
        validation_data=validation_data,
        validation_split=validation_split,
        validation_freq=validation_freq,
        validation_every=validation_every,
        metrics=None if metrics is None else _taken(metrics),
        log_every=log_every,
        early_stopping=early_stopping,
        callbacks=callbacks,
        devices=devices,
        mesh=mesh,
        shard=shard,
        ensemble=ensemble,
        precision=precision,
        ema=ema,
        validate_ema=validate_ema,
        norms=norms,
        microbatches=microbatches,
        remat=remat,
        peak_flops=peak_flops,
        signals=signals,
        schedules=schedules,
        profile=profile,
        execution=execution,
        loss=loss,
        optimizer=optimizer,
        updates=updates,
        trains=trains,
        filter_spec=filter_spec,
    )
    keeping = Keeping.of(checkpoint, checkpoint_every, options)
    ready, build = open_and_build(
        model, data, validation_data, state, opt_state, options, keeping, _PLANNING.get()
    )
    return _compile_and_drive(ready, build, model, began)


def _compile_and_drive(
    ready: Ready, build: Callable[[int], Ready], model: Model, began: float
) -> FitResult[Model]:
    """Compiles the run's programs and drives them to the run's end (with `plan`, stops
    once they are compiled).
    """
    # Ctrl-C deferred from here on: one while XLA compiles stops the run at its first
    # epoch's end, a second one is raised once the compilation returns, and every way out
    # waits for the threads that compile: the process must not exit with XLA still at
    # work in it.
    with contextlib.ExitStack() as stack:
        interrupt = stack.enter_context(Interrupt(ready.options.signals).deferred())
        plan = None
        auto = ready.options.auto_microbatches
        if auto is not None:
            ready, plan = choose_microbatches(auto, ready, build, model)
        elif ready.options.progress or _PLANNING.get():
            plan = plan_of(ready, model)
        if _PLANNING.get():
            assert plan is not None
            if interrupt.requested:  # answered once the compilation is done
                raise KeyboardInterrupt(f"`eqfit.plan` stopped by {interrupt.signal}.")
            raise _Planned(plan)
        options, loop, start, source, _, _ = ready
        costs = step_costs(loop, model, source, start, options, plan)
        if costs is not None:  # a count of its FLOPs in a thread ends before `fit` does
            stack.push(lambda error, *_: costs.join(warn=error is None))
        return train(ready, interrupt=interrupt, costs=costs, plan=plan, stack=stack, began=began)


# Set while `plan` runs `fit`: `fit` then stops once its programs are compiled, and
# raises `_Planned` with what they need, instead of training.
_PLANNING: contextvars.ContextVar[bool] = contextvars.ContextVar("eqfit_planning", default=False)


class _Planned(BaseException):
    """How `fit` hands `plan` its plan: raised past `fit`'s own checks and handlers."""

    def __init__(self, plan: Plan):
        super().__init__()
        self.plan = plan


@takes_arguments_of(fit, Plan)
def plan(*args: Any, **kwargs: Any) -> Plan:
    """Compiles the run that `fit` with these arguments would make, trains nothing, and
    tells what it will need: memory per device, FLOPs, the model's arrays and their
    layout.

    It takes exactly `fit`'s arguments, checks them as `fit` does, and compiles the very
    programs `fit` calls, into eqfit's cache: a `fit` with the same arguments (the same
    optimizer and loss objects) afterwards compiles nothing more. Nothing is read from a
    loader but what opening it reads (its first batch or two), so a generator or one-shot
    iterator given to `plan` is not the one to give `fit` then (`fit` refuses a
    generator `plan` read from); nothing trains.

    A Ctrl-C (or a signal of `signals`) while it compiles is answered once XLA's
    compilation is done, seconds later for a large model, with a `KeyboardInterrupt`;
    a second Ctrl-C is answered at once, and the compilation goes on in a thread that
    Python waits for before the process exits.

    !!! example

        ```python
        plan = eqfit.plan(model, (x, y), loss=eqfit.losses.mse, optimizer=opt, key=key)
        print(plan)                # the arrays, memory per device, FLOPs
        plan.memory.temporary      # XLA's temporary bytes, per device
        plan.arguments.optimizer_state  # the optimizer state's bytes, per device
        result = eqfit.fit(model, (x, y), loss=eqfit.losses.mse, optimizer=opt, key=key)
        ```

    **Arguments:**

    As [`eqfit.fit`][]'s.

    **Returns:**

    A [`eqfit.Plan`][]. Its memory is XLA's `memory_analysis()` of the compiled run, per
    device, and its arguments' split into parameters, optimizer state, the average,
    model state and data ([`eqfit.ArgumentBytes`][]); its FLOPs per step and per
    validation pass are XLA's `cost_analysis()` of one step, and of one pass, lowered
    alone.
    A loader without `len` learns its epoch's length as it trains, and a loader's smaller
    last batch has a program of its own: these compile when `fit` meets them.
    """
    token = _PLANNING.set(True)
    try:
        fit(*args, **kwargs)
    except _Planned as planned:
        return planned.plan
    finally:
        _PLANNING.reset(token)
    raise AssertionError("`fit` trained while planning")
