"""Research code as a typed API consumer writes it, calling every public entry point.

Not a test that pytest runs: `.ci/run` type-checks it with pyright in strict mode and with
mypy, and no error may come from eqfit. Each `assert_type` pins what a checker sees.
"""

from pathlib import Path
from typing import Any, assert_type

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax  # type: ignore[import-untyped]  # optax ships neither stubs nor py.typed
from jaxtyping import Array, Float

import eqfit
from eqfit.callbacks import CSVLogger, TensorBoard
from eqfit.models import CNN, LinearRegression, MLP


class Affine(eqx.Module):
    weight: Float[Array, "3 2"]

    def __call__(self, x: Float[Array, " 2"]) -> Float[Array, " 3"]:
        return self.weight @ x


class Stateful(eqx.Module):
    weight: Float[Array, "3 2"]

    def __call__(
        self, x: Float[Array, " 2"], state: eqx.nn.State
    ) -> tuple[Float[Array, " 3"], eqx.nn.State]:
        return self.weight @ x, state


class Printer:
    stops_training: bool = False

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> bool | None:
        print(epoch, logs)
        return None


def train(directory: Path) -> None:
    key = jax.random.key(0)
    x = np.zeros((64, 2), np.float32)
    y = np.zeros((64, 3), np.float32)
    model = Affine(jax.random.normal(key, (3, 2)))

    result = eqfit.fit(
        model,
        (x, y),
        loss=eqfit.losses.mse,
        optimizer=optax.adam(1e-3),
        key=key,
        epochs=2,
        batch_size=16,
        metrics={"mae": eqfit.metrics.mae},
        validation_split=0.25,
        early_stopping=eqfit.EarlyStopping(patience=1, monitor="val_loss"),
        callbacks=[Printer(), CSVLogger(directory / "log.csv")],
        checkpoint=directory / "checkpoints",
    )
    assert_type(result, eqfit.FitResult[Affine])
    assert_type(result.model, Affine)
    assert_type(result.model.weight, Float[Array, "3 2"])
    assert_type(result.history, eqfit.History)
    assert_type(result.history.loss, np.ndarray)
    assert_type(result.history.val_loss, np.ndarray | None)
    # `best_epoch`: an int, or a tuple of one per member for an ensemble.
    assert_type(result.history.best_epoch, int | tuple[int | None, ...] | None)
    assert_type(result.opt_state, eqfit.OptState)
    assert_type(result.state, eqfit.ModelState | None)

    more = eqfit.fit(
        result.model,
        (x, y),
        loss=eqfit.losses.mse,
        optimizer=optax.adam(1e-3),
        key=key,
        epochs=4,
        initial_epoch=2,
        opt_state=result.opt_state,
        progress=True,
    )
    assert_type(more, eqfit.FitResult[Affine])

    # Real models: mixed precision, a moving average (of the model's own type), norms,
    # gradient accumulation.
    averaged = eqfit.fit(
        model,
        (x, y),
        loss=eqfit.losses.mse,
        optimizer=optax.adam(1e-3),
        key=key,
        precision=eqfit.Precision(jnp.bfloat16, keep=(r"norm",)),
        ema=0.999,
        norms=True,
        batch_size=32,
        microbatches=4,
    )
    assert_type(averaged.ema_model, Affine | None)
    assert_type(averaged.history.step_values, dict[str, np.ndarray])
    eqfit.fit(
        model, (x, y), loss=eqfit.losses.mse, optimizer=optax.sgd(0.1), key=key, precision="float16"
    )

    # `predict` returns what the model returns (for every example).
    assert_type(eqfit.predict(more.model, x, batch_size=32), Float[Array, " 3"])
    assert_type(eqfit.predict(more.model, x, ensemble=True), Array)
    # Floats, and numpy arrays for metrics whose values are arrays (a confusion matrix).
    values = eqfit.evaluate(more.model, (x, y), loss=eqfit.losses.mse)
    assert_type(values, dict[str, Any])

    eqfit.save(directory / "result.eqx", more)
    assert_type(eqfit.load(directory / "result.eqx", like=more), eqfit.FitResult[Affine])
    assert_type(eqfit.load(str(directory / "result.eqx"), like=more.model), Affine)

    try:
        eqfit.fit(model, (x, y), loss=eqfit.losses.mse, optimizer=optax.sgd(0.1), key=key)
    except eqfit.NonFiniteLossError as e:
        assert_type(e.result, eqfit.FitResult[Any])
        assert_type(e.epoch, int)
    except eqfit.TrainingInterrupted as e:
        assert_type(e.result, eqfit.FitResult[Any])
    except eqfit.CheckpointError as e:
        print(e.result)
    assert_type(eqfit.wait_for_checkpoints(), None)

    eqfit.enable_compilation_cache(directory / "jax")
    eqfit.clear_cache()
    assert_type(eqfit.__version__, str)
    print(TensorBoard(directory / "tb").logdir)


def ready_models() -> None:
    key = jax.random.key(1)
    linear = LinearRegression(4, key=key)
    mlp = MLP(4, 10, 8, 2, key=key)
    cnn = CNN(1, (8, 8), 10, key=key)
    digits = np.zeros((32, 1, 8, 8), np.float32)
    labels = np.zeros((32,), np.int32)
    trained = eqfit.fit(
        cnn,
        (digits, labels),
        loss=eqfit.losses.softmax_cross_entropy,
        optimizer=optax.adam(1e-3),
        key=key,
        metrics={"accuracy": eqfit.metrics.accuracy},
    )
    assert_type(trained.model, CNN)
    assert_type(linear, LinearRegression)
    assert_type(mlp, MLP)
    assert_type(eqfit.predict(cnn, digits), Array)
    assert_type(eqfit.predict(mlp, np.zeros((8, 4), np.float32)), Array)
    # A raw key, as Equinox's layers take, and early stopping with Keras's defaults.
    assert_type(MLP(4, 10, 8, 2, key=jax.random.PRNGKey(0)), MLP)
    assert_type(eqfit.EarlyStopping(), eqfit.EarlyStopping)


def stateful(model: Stateful, state: eqx.nn.State) -> None:
    x = np.zeros((16, 2), np.float32)
    # Given `state=`, the model returns `(output, state)` and `predict` the outputs.
    assert_type(eqfit.predict(model, x, state=state), Float[Array, " 3"])


class Twin(eqx.Module):
    online: eqx.nn.Linear
    target: eqx.nn.Linear


class Polyak(eqfit.AbstractUpdate):
    """An update of one's own: the target moved towards the online network."""

    name: str = "target"
    tau: float = 0.01

    def init(self, params: Any) -> None:
        return None

    def apply(
        self, model: Any, state: Any, batch: Any, *, model_state: Any, key: Array
    ) -> eqfit.Applied:
        target = jax.tree.map(
            lambda t, o: (1 - self.tau) * t + self.tau * o, model.target, model.online
        )
        model = eqx.tree_at(lambda m: m.target, model, target)
        return eqfit.Applied(model, state, model_state, {})


class Seeded(eqfit.AbstractUpdate):
    """An update whose state starts from a key: `init` takes one, `fit` passes it."""

    name: str = "seeded"

    def init(self, params: Any, *, key: Array | None = None) -> Array:
        assert key is not None
        return jax.random.normal(key, (3,))

    def apply(
        self, model: Any, state: Any, batch: Any, *, model_state: Any, key: Array
    ) -> eqfit.Applied:
        return eqfit.Applied(model, state, model_state, {"first": state[0]})


def several_updates(twin: Twin, x: Array, y: Array) -> None:
    def online_loss(model: Twin, x: Array, y: Array) -> Array:
        return jnp.mean((jax.vmap(model.online)(x) - y) ** 2)

    result = eqfit.fit(
        twin,
        (x, y),
        key=jax.random.key(0),
        updates=[
            eqfit.Update("q", online_loss, optax.adam(1e-3), trains=lambda m: m.online),
            Polyak(trains=lambda m: m.target, every=2),
            Seeded(trains=lambda m: m.target),
        ],
    )
    assert_type(result.model, Twin)


def weighted_mean(model: eqfit.models.MLP, x: Array, y: Array, mask: Array) -> None:
    def masked(model: eqfit.models.MLP, x: Array, y: Array, mask: Array) -> eqfit.Mean:
        squared = (jax.vmap(model)(x) - y) ** 2
        return eqfit.Mean(jnp.sum(squared * mask), jnp.sum(mask))

    result = eqfit.fit(
        model, (x, y, mask), loss=masked, optimizer=optax.sgd(0.1), key=jax.random.key(0)
    )
    assert_type(result.model, eqfit.models.MLP)
    mean = eqfit.Mean.of(jnp.ones(3), mask[:3])
    assert_type(mean.value, Float[Array, ""])
    assert_type(mean, eqfit.Mean)
