"""Speed of `eqfit.fit` on small research steps, against a hand-written scan of the same step.

Research code often trains steps of a fraction of a millisecond: a DQN's TD update, a
WGAN-GP critic's step. There eqfit's own work per step (history, checks, keys) weighs the
most. For each workload below it measures the steady time per training step three ways:

1. `eqfit`: `eqfit.fit(model, data, loss=..., optimizer=..., trains=..., key=...,
   epochs=E, batch_size=B, drop_remainder=True)`: the whole run as one XLA program. Timed
   from the second call on, with the same model, loss, optimizer and `trains` objects, so
   that nothing recompiles; nothing is subtracted (its host work per call is in the time).
2. `scan`: the floor, a hand-written `jax.jit` of a `lax.scan` over epochs of a
   `lax.scan` over the epoch's batches (as in model_families.py), shuffled by
   `jax.random.permutation` each epoch, each batch gathered inside the scan, the
   remainder dropped; the trained arrays split from the rest with `eqx.partition` (the
   frozen arrays passed in as arguments), the same loss; a loss that takes a `key` gets
   `fold_in(fold_in(key, 1), t)` at step `t`, as eqfit gives it. It returns each step's
   loss (and aux values), as eqfit records them.
3. `floor`: the same scan, but shuffled with eqfit's own shuffle
   (`eqfit._core._data.epoch_order`, as fit_speed.py's floor) and each batch gathered
   with the in-bounds promise eqfit makes: the same work as eqfit's. On a CPU
   `jax.random.permutation` (sorts of random keys) is a sizeable part of a small step, so
   `scan` can be slower than eqfit by its shuffle alone; `eqfit/floor` is eqfit's own
   overhead.

The workloads (all float32):

- `dqn`: a DQN TD update on a replay buffer, as CleanRL's `dqn_jax.py` writes it: a
  QNetwork 4 -> 120 -> 84 -> 2 (`Linear` layers, relu) and a target network of the same
  shape, both in one model, only the online one trained (`trains=lambda m: m.q`); TD
  target `r + 0.99 * (1 - done) * max_a target(next_obs)`, MSE on `Q(obs)[action]`.
  A buffer of N=10,000 random transitions (obs (N, 4), action int32, reward, next_obs,
  done), batch 128 (78 steps an epoch, the remainder dropped), 24 epochs,
  `optax.adam(2.5e-4)`.
- `critic`: a WGAN-GP critic step on 2-D points: critic `eqx.nn.MLP` 2 -> 128 -> 128 -> 1,
  a fixed generator (`eqx.nn.MLP` 2 -> 128 -> 128 -> 2, not trained: `trains=lambda m:
  m.critic`), the gradient penalty of docs/guides/research.md's `critic_loss` (a loss
  taking `key`, with aux values `distance` and `penalty`); N=8192 points of a mixture of
  8 Gaussians, batch 64, 8 epochs, `optax.adam(1e-4, b1=0.5, b2=0.9)`.
- `mlp`: the benchmarks' MLP, `eqfit.models.MLP(16, "scalar", 64, 2)`, MSE, N=8192
  synthetic samples, batch 32, `optax.adam(1e-3)` (as in fit_speed.py and
  model_families.py, but 25 epochs, not 5): a reference, its step smaller than the
  others'.

And with `--given-batches`, a fourth comparison, against the floor a JAX user writes when
the minibatches are given (the DQN of issue "A NaN found, not only stopped", item 3):
CleanRL's QNetwork and `optax.adam(2.5e-4)` as above, 2,000 minibatches of 128 drawn
beforehand (with replacement) from a replay buffer of 50,000 transitions and stacked as
a `jax.jit`'d `lax.scan`'s `xs` (`(2000, 128, ...)`), the target network copied from the
online one every 50 steps by a `lax.cond`, no NaN guard (`given_floor`); against eqfit
given the same rows as flat arrays with `shuffle=False`, `batch_size=128` and
`updates=[eqfit.Update("q", ...), TargetCopy(every=50)]` (`given_eqfit`), both as `fit`
chooses and with no NaN guard (`WholeRun(guard=False)`). Its ratio is
named `eqfit/given_floor`: the floors differ (eqfit's shuffle and gather are not in this
one), so each is reported under its own name.

And with `--guards`, each workload (and the given-minibatch DQN) as eqfit runs it with
the NaN guard, a `lax.cond` around each update (`WholeRun(guard=True)`), against with
none (`WholeRun(guard=False)`, the default wherever a run can be replayed to the state
before a non-finite step; on a CPU, a small step's operations then ordered for memory):
`none/guard`.

Each workload's epochs are set so that one run takes a few tenths of a second on a 2-core
CPU. The three ways of a workload are timed in one process, interleaved (the order rotated
each repeat, each preceded by one untimed run), each sample the median of 3 back-to-back
runs, reported as medians over repeats: µs per step and the ratios eqfit/scan and
eqfit/floor (of the medians, and the medians of the paired same-repeat ratios) against the
target of 1.05. The
first call of each way (compile included) is timed apart, before the warm-up. A JAX
compile-event listener counts the XLA compilations of each way's timed calls: they must be
0. The 1-minute load average before and after is printed.

    python benchmarks/small_steps.py [--repeats 5] [--quick] [--workloads dqn,critic,mlp]
        [--given-batches] [--out PATH]
"""

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import (
    CompileEvents,
    config,
    finish,
    load_average,
    median,
    regression_data,
    table,
    timed,
)

import eqfit
from eqfit._core._data import epoch_order, shuffle_seed


TARGET = 1.05  # eqfit/scan and eqfit/floor must be at most this
GAMMA = 0.99  # DQN's discount
LATENT = 2  # the WGAN generator's input
WAYS = ("eqfit", "scan", "floor")

Run = Callable[[], Any]  # one full training run; blocks until the device is done


# ---------------------------------------------------------------------------------------
# The workloads


class QNetwork(eqx.Module):
    """CleanRL's QNetwork: Dense(120), relu, Dense(84), relu, Dense(actions)."""

    layers: tuple[eqx.nn.Linear, eqx.nn.Linear, eqx.nn.Linear]

    def __init__(self, observations: int, actions: int, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = (
            eqx.nn.Linear(observations, 120, key=k1),
            eqx.nn.Linear(120, 84, key=k2),
            eqx.nn.Linear(84, actions, key=k3),
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        first, second, last = self.layers
        return last(jax.nn.relu(second(jax.nn.relu(first(x)))))


class DQN(eqx.Module):
    """The online network, trained, and its target network, frozen."""

    q: QNetwork
    target: QNetwork


def td_loss(
    model: DQN,
    obs: jax.Array,
    action: jax.Array,
    reward: jax.Array,
    next_obs: jax.Array,
    done: jax.Array,
) -> jax.Array:
    """CleanRL dqn_jax.py's update: MSE of Q(obs)[action] against the TD target."""
    q_next = jnp.max(jax.vmap(model.target)(next_obs), axis=-1)
    target = jax.lax.stop_gradient(reward + (1 - done) * GAMMA * q_next)
    q = jax.vmap(model.q)(obs)
    q_taken = q[jnp.arange(q.shape[0]), action]
    return jnp.mean((q_taken - target) ** 2)


class WGAN(eqx.Module):
    critic: eqx.nn.MLP
    generator: eqx.nn.MLP


def critic_loss(
    wgan: WGAN, points: jax.Array, *, key: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """docs/guides/research.md's WGAN-GP critic loss, on 2-D points."""
    noise_key, mix_key = jax.random.split(key)
    latents = jax.random.normal(noise_key, (points.shape[0], LATENT))
    fake = jax.vmap(wgan.generator)(latents)
    mix = jax.random.uniform(mix_key, (points.shape[0], 1))
    between = mix * points + (1 - mix) * fake
    slopes = jax.vmap(jax.grad(lambda x: wgan.critic(x).squeeze()))(between)
    norms = jnp.sqrt(jnp.sum(slopes**2, axis=1))
    distance = jnp.mean(jax.vmap(wgan.critic)(points)) - jnp.mean(jax.vmap(wgan.critic)(fake))
    penalty = jnp.mean((norms - 1) ** 2)
    return -distance + 10 * penalty, {"distance": distance, "penalty": penalty}


def train_q(model: DQN) -> QNetwork:
    return model.q


def train_critic(wgan: WGAN) -> eqx.nn.MLP:
    return wgan.critic


@dataclass
class Workload:
    name: str
    description: str
    model: Any
    data: tuple[jax.Array, ...]
    loss: Callable[..., Any]
    optimizer: Callable[[], optax.GradientTransformation]  # a new one per way
    optimizer_text: str
    trains: Callable[[Any], Any] | None
    batch_size: int
    epochs: int
    has_aux: bool = False
    takes_key: bool = False

    @property
    def num_samples(self) -> int:
        return int(self.data[0].shape[0])

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.batch_size  # the remainder dropped

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def trained_spec(self) -> Any:
        """True on the arrays that train: those inside `trains`, or every float array."""
        if self.trains is None:
            return jax.tree.map(eqx.is_inexact_array, self.model)
        falses = jax.tree.map(lambda _: False, self.model)
        picked = jax.tree.map(eqx.is_inexact_array, self.trains(self.model))
        return eqx.tree_at(self.trains, falses, replace=picked)


def replay_buffer(rng: np.random.Generator, n: int) -> tuple[np.ndarray, ...]:
    """A CartPole-shaped replay buffer of `n` transitions drawn from `rng`: observations,
    actions, rewards, next observations near the observations, and done flags (2%).
    """
    obs = rng.normal(size=(n, 4)).astype(np.float32)
    return (
        obs,
        rng.integers(0, 2, n).astype(np.int32),
        np.ones(n, np.float32),
        (obs + 0.05 * rng.normal(size=(n, 4))).astype(np.float32),
        (rng.random(n) < 0.02).astype(np.float32),
    )


def make_workloads(names: list[str], quick: bool) -> list[Workload]:
    """The workloads named, their data on the device; a quarter of the epochs with
    `--quick`."""
    key = jax.random.key(0)
    rng = np.random.default_rng(0)

    def dqn() -> Workload:
        data = replay_buffer(rng, 10_000)
        q_key, target_key = jax.random.split(key)
        model = DQN(QNetwork(4, 2, q_key), QNetwork(4, 2, target_key))
        desc = "DQN TD update: QNetwork 4-120-84-2, frozen target net; MSE on Q[a]"
        return Workload(
            "dqn",
            desc,
            model,
            data,
            td_loss,
            lambda: optax.adam(2.5e-4),
            "adam(2.5e-4)",
            train_q,
            batch_size=128,
            epochs=24,
        )

    def critic() -> Workload:
        n = 8192
        angles = rng.integers(0, 8, n) * (2 * np.pi / 8)
        centres = 2 * np.stack([np.cos(angles), np.sin(angles)], axis=1)
        points = (centres + 0.02 * rng.normal(size=(n, 2))).astype(np.float32)
        critic_key, generator_key = jax.random.split(key)
        model = WGAN(
            eqx.nn.MLP(2, 1, 128, 2, key=critic_key),
            eqx.nn.MLP(LATENT, 2, 128, 2, key=generator_key),
        )
        desc = "WGAN-GP critic: MLP 2-128-128-1, fixed generator 2-128-128-2, GP"
        return Workload(
            "critic",
            desc,
            model,
            (points,),
            critic_loss,
            lambda: optax.adam(1e-4, b1=0.5, b2=0.9),
            "adam(1e-4, b1=0.5, b2=0.9)",
            train_critic,
            batch_size=64,
            epochs=8,
            has_aux=True,
            takes_key=True,
        )

    def mlp() -> Workload:
        x, y = regression_data(8192, 16, seed=0)
        model = eqfit.models.MLP(16, "scalar", 64, 2, key=key)
        return Workload(
            "mlp",
            "MLP 16-64-64-1, MSE (the benchmarks' MLP)",
            model,
            (x, y),
            eqfit.losses.mse,
            lambda: optax.adam(1e-3),
            "adam(1e-3)",
            None,
            batch_size=32,
            epochs=25,
        )

    builders: dict[str, Callable[[], Workload]] = dict(dqn=dqn, critic=critic, mlp=mlp)
    workloads = []
    for name in names:
        workload = builders[name]()
        workload.data = tuple(jnp.asarray(a) for a in workload.data)
        if quick:
            workload.epochs = max(1, workload.epochs // 4)
        workloads.append(workload)
    return workloads


WORKLOADS = ("dqn", "critic", "mlp")


# ---------------------------------------------------------------------------------------
# The three ways


def make_scan(w: Workload, same_shuffle: bool) -> Run:
    """A jitted whole run: a `lax.scan` over epochs of a `lax.scan` over batches, shuffled
    by `jax.random.permutation`, or with `same_shuffle` by eqfit's shuffle."""
    optimizer = w.optimizer()
    params, rest = eqx.partition(w.model, w.trained_spec())
    frozen, static = eqx.partition(rest, eqx.is_array)
    opt_state = optimizer.init(params)
    n, steps, epochs, batch = w.num_samples, w.steps_per_epoch, w.epochs, w.batch_size
    key = jax.random.key(0)

    def loss_fn(p: Any, frozen: Any, batch: tuple[jax.Array, ...], key: jax.Array) -> Any:
        model = eqx.combine(p, frozen, static)
        return w.loss(model, *batch, key=key) if w.takes_key else w.loss(model, *batch)

    def gather(a: jax.Array, idx: jax.Array) -> jax.Array:
        if same_shuffle:  # a permutation's indices: in bounds and unique, as eqfit says
            return a.at[idx].get(mode="promise_in_bounds", unique_indices=True)
        return a[idx]

    @jax.jit
    def train(p: Any, opt_state: Any, frozen: Any, data: Any, key: jax.Array) -> Any:
        step_keys = jax.random.fold_in(key, 1)

        def epoch(carry: Any, e: jax.Array) -> Any:
            def step(carry: Any, xs: tuple[jax.Array, jax.Array]) -> Any:
                p, opt_state = carry
                idx, t = xs
                batch = tuple(gather(a, idx) for a in data)
                step_key = jax.random.fold_in(step_keys, t)
                grad_fn = jax.value_and_grad(loss_fn, has_aux=w.has_aux)
                values, grads = grad_fn(p, frozen, batch, step_key)
                updates, opt_state = optimizer.update(grads, opt_state, p)
                return (optax.apply_updates(p, updates), opt_state), values

            if same_shuffle:
                order = epoch_order(shuffle_seed(key), e, n, True)
            else:
                order = jax.random.permutation(jax.random.fold_in(key, e), n)
            idx = order[: steps * batch].reshape(steps, batch)
            return jax.lax.scan(step, carry, (idx, e * steps + jnp.arange(steps)))

        return jax.lax.scan(epoch, (p, opt_state), jnp.arange(epochs))

    return lambda: jax.block_until_ready(train(params, opt_state, frozen, w.data, key))


def make_eqfit(w: Workload, execution: Any = "auto") -> Run:
    optimizer = w.optimizer()
    key = jax.random.key(0)

    def run() -> eqfit.FitResult:
        # `fit` reads its history back before it returns: nothing is left in flight.
        return eqfit.fit(
            w.model,
            w.data,
            loss=w.loss,
            optimizer=optimizer,
            trains=w.trains,
            key=key,
            epochs=w.epochs,
            batch_size=w.batch_size,
            drop_remainder=True,
            execution=execution,
        )

    return run


# ---------------------------------------------------------------------------------------
# The DQN on given minibatches, with a target network copied every 50 steps

GIVEN_STEPS, GIVEN_BATCH, GIVEN_BUFFER, TARGET_EVERY = 2000, 128, 50_000, 50


class TargetCopy(eqfit.AbstractUpdate):
    """CleanRL's hard target update: the online network copied into the target."""

    name: str = "target"

    def init(self, params: Any) -> Any:
        return None

    def apply(
        self, model: Any, state: Any, batch: Any, *, model_state: Any, key: jax.Array
    ) -> eqfit.Applied:
        copied = eqx.tree_at(lambda m: m.target, model, model.q)
        return eqfit.Applied(copied, state, model_state, {})


def given_problem() -> tuple[DQN, tuple[jax.Array, ...]]:
    """The model and the minibatches, `(GIVEN_STEPS, GIVEN_BATCH, ...)`, drawn beforehand
    from a replay buffer."""
    rng = np.random.default_rng(1)
    buffer = replay_buffer(rng, GIVEN_BUFFER)
    drawn = rng.integers(0, GIVEN_BUFFER, size=(GIVEN_STEPS, GIVEN_BATCH))
    batches = tuple(jnp.asarray(a[drawn]) for a in buffer)
    q_key, target_key = jax.random.split(jax.random.key(2))
    q = QNetwork(4, 2, q_key)
    return DQN(q, q), batches


def make_given_floor(model: DQN, batches: tuple[jax.Array, ...]) -> Run:
    optimizer = optax.adam(2.5e-4)
    q, static = eqx.partition(model.q, eqx.is_array)
    opt_state = optimizer.init(q)

    @jax.jit
    def train(q: Any, target: Any, opt_state: Any, batches: Any) -> Any:
        def step(carry: Any, batch: tuple[jax.Array, ...]) -> Any:
            q, target, opt_state, t = carry

            def loss(q: Any) -> jax.Array:
                online, frozen = eqx.combine(q, static), eqx.combine(target, static)
                return td_loss(DQN(online, frozen), *batch)

            value, grads = jax.value_and_grad(loss)(q)
            updates, opt_state = optimizer.update(grads, opt_state, q)
            q = optax.apply_updates(q, updates)
            due = (t + 1) % TARGET_EVERY == 0
            target = jax.lax.cond(due, lambda: q, lambda: target)
            return (q, target, opt_state, t + 1), value

        return jax.lax.scan(step, (q, target, opt_state, jnp.int32(0)), batches)

    return lambda: jax.block_until_ready(train(q, q, opt_state, batches))


def make_given_eqfit(model: DQN, batches: tuple[jax.Array, ...], execution: Any = "auto") -> Run:
    flat = tuple(a.reshape(GIVEN_STEPS * GIVEN_BATCH, *a.shape[2:]) for a in batches)
    updates = [
        eqfit.Update("q", td_loss, optax.adam(2.5e-4), trains=train_q),
        TargetCopy(trains=lambda m: m.target, every=TARGET_EVERY),
    ]
    key = jax.random.key(0)

    def run() -> eqfit.FitResult:
        return eqfit.fit(
            model,
            flat,
            updates=updates,
            key=key,
            batch_size=GIVEN_BATCH,
            shuffle=False,
            execution=execution,
        )

    return run


def measure_given(repeats: int, inner: int, events: CompileEvents) -> dict[str, Any]:
    """`given_eqfit`, as `fit` chooses (`eqfit`) and with no NaN guard (`eqfit_no_guard`:
    `WholeRun(guard=False)`), against `given_floor`, interleaved (`interleaved`).
    """
    model, batches = given_problem()
    runs = {
        "eqfit": make_given_eqfit(model, batches),
        "eqfit_no_guard": make_given_eqfit(model, batches, eqfit.WholeRun(guard=False)),
        "floor": make_given_floor(model, batches),
    }
    measured = interleaved(runs, repeats, inner, events)
    first, samples = measured["first_call_s"], measured["runs_s"]
    compiles = measured["steady_recompiles"]
    per_step = {k: median(v) / GIVEN_STEPS * 1e6 for k, v in samples.items()}
    print("\n## DQN on given minibatches, target copied every 50 steps (`--given-batches`)\n")
    rows, ratios = [], {}
    for way in ("eqfit", "eqfit_no_guard"):
        paired = median([a / b for a, b in zip(samples[way], samples["floor"])])
        ratio = per_step[way] / per_step["floor"]
        ratios |= {f"{way}/given_floor": ratio, f"{way}/given_floor_paired": paired}
        rows.append(
            [
                way,
                str(GIVEN_STEPS),
                f"{per_step[way]:,.1f}",
                f"{per_step['floor']:,.1f}",
                f"{ratio:.3f} ({paired:.3f})",
                "yes" if ratio <= TARGET else "no",
                f"{first[way]:.2f} {first['floor']:.2f}",
                f"{compiles[way]} {compiles['floor']}",
            ]
        )
    header = ["way", "steps", "µs", "given_floor µs", "way/given_floor", f"≤ {TARGET}"]
    print(table([*header, "first s (way floor)", "compiles timed"], rows))
    return {
        "us_per_step": per_step,
        "ratios": ratios,
        "runs_s": samples,
        "first_call_s": first,
        "steady_recompiles": compiles,
        "target": TARGET,
    }


# ---------------------------------------------------------------------------------------
# Timing


def interleaved(
    runs: dict[str, Run], repeats: int, inner: int, events: CompileEvents
) -> dict[str, Any]:
    """First calls (compile included), then the ways' steady state, interleaved: each
    repeat visits them in an order rotated by one, each preceded by one untimed run, each
    sample the median of `inner` back-to-back runs; and the compiles of the timed runs.
    """
    names = list(runs)
    first = {name: timed(run) for name, run in runs.items()}
    for run in runs.values():  # warm-up: caches, allocator, thread pools
        run()
        run()
    samples: dict[str, list[float]] = {name: [] for name in names}
    compiles = {name: 0 for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            events.reset()
            runs[name]()  # untimed: the first run after another way is slower
            times = [timed(runs[name]) for _ in range(inner)]
            compiles[name] += events.backend_compiles()
            samples[name].append(median(times))
    return {"first_call_s": first, "runs_s": samples, "steady_recompiles": compiles}


def measure(w: Workload, repeats: int, inner: int, events: CompileEvents) -> dict[str, Any]:
    """First calls, then the interleaved steady state, of one workload's three ways."""
    runs = {"eqfit": make_eqfit(w), "scan": make_scan(w, False), "floor": make_scan(w, True)}
    measured = interleaved(runs, repeats, inner, events)
    print(f"  {w.name}: done", file=sys.stderr)
    return measured


# ---------------------------------------------------------------------------------------
# The NaN guard: each update in a `lax.cond`, or none (`--guards`)


def measure_guards(
    workloads: list[Workload], repeats: int, inner: int, events: CompileEvents
) -> dict[str, Any]:
    """Each workload (and the given-minibatch DQN) as eqfit runs it with the guard
    (`WholeRun(guard=True)`) and without (`WholeRun(guard=False)`), interleaved; prints
    the table of µs per step and returns the numbers.
    """
    guarded, unguarded = eqfit.WholeRun(guard=True), eqfit.WholeRun(guard=False)
    problems: dict[str, tuple[dict[str, Run], int]] = {
        w.name: ({"guard": make_eqfit(w, guarded), "none": make_eqfit(w, unguarded)}, w.steps)
        for w in workloads
    }
    model, batches = given_problem()
    problems["dqn_given"] = (
        {
            "guard": make_given_eqfit(model, batches, guarded),
            "none": make_given_eqfit(model, batches, unguarded),
        },
        GIVEN_STEPS,
    )
    results, rows = {}, []
    for name, (runs, steps) in problems.items():
        m = interleaved(runs, repeats, inner, events)
        per_step = {way: median(m["runs_s"][way]) / steps * 1e6 for way in runs}
        paired = median([a / b for a, b in zip(m["runs_s"]["none"], m["runs_s"]["guard"])])
        ratio = per_step["none"] / per_step["guard"]
        results[name] = {"us_per_step": per_step, "none/guard": ratio, **m}
        cells = [f"{per_step['guard']:,.1f}", f"{per_step['none']:,.1f}"]
        rows.append([name, str(steps), *cells, f"{ratio:.3f} ({paired:.3f})"])
        print(f"  {name}: done", file=sys.stderr)
    print("\n## The NaN guard (`--guards`): µs per step with and without it\n")
    header = ["workload", "steps", "guard µs", "no guard µs", "none/guard (paired)"]
    print(table(header, rows))
    return results


# ---------------------------------------------------------------------------------------
# Report


def report(workloads: list[Workload], measured: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Prints the tables and returns the same numbers for the JSON file."""
    results: dict[str, Any] = {}
    rows, spread_rows, what_rows = [], [], []
    for w in workloads:
        m = measured[w.name]
        per_step = {way: median(m["runs_s"][way]) / w.steps * 1e6 for way in WAYS}

        def paired(base: str) -> float:
            return median([a / b for a, b in zip(m["runs_s"]["eqfit"], m["runs_s"][base])])

        ratios = {
            "eqfit/scan": per_step["eqfit"] / per_step["scan"],
            "eqfit/floor": per_step["eqfit"] / per_step["floor"],
            "eqfit/scan_paired": paired("scan"),
            "eqfit/floor_paired": paired("floor"),
        }
        parameters = sum(x.size for x in jax.tree.leaves(eqx.filter(w.model, w.trained_spec())))
        results[w.name] = {
            "description": w.description,
            "optimizer": w.optimizer_text,
            "num_samples": w.num_samples,
            "batch_size": w.batch_size,
            "epochs": w.epochs,
            "steps": w.steps,
            "trained_parameters": parameters,
            "us_per_step": per_step,
            "ratios": ratios,
            "target": TARGET,
            "within_target": {
                "scan": ratios["eqfit/scan"] <= TARGET,
                "floor": ratios["eqfit/floor"] <= TARGET,
            },
            **m,
        }
        what_rows.append(
            [
                w.name,
                w.description,
                f"{parameters:,}",
                f"{w.num_samples:,}",
                str(w.batch_size),
                str(w.epochs),
                str(w.steps),
                w.optimizer_text,
            ]
        )
        rows.append(
            [
                w.name,
                str(w.steps),
                *(f"{per_step[way]:,.1f}" for way in WAYS),
                f"{ratios['eqfit/scan']:.3f} ({ratios['eqfit/scan_paired']:.3f})",
                f"{ratios['eqfit/floor']:.3f} ({ratios['eqfit/floor_paired']:.3f})",
                " ".join(
                    f"{b} {'yes' if ratios[f'eqfit/{b}'] <= TARGET else 'no'}"
                    for b in ("scan", "floor")
                ),
            ]
        )
        spread_rows.append(
            [
                w.name,
                *(
                    f"{min(m['runs_s'][way]) * 1e3:,.1f}–{max(m['runs_s'][way]) * 1e3:,.1f}"
                    for way in WAYS
                ),
                " ".join(f"{m['first_call_s'][way]:.2f}" for way in WAYS),
                " ".join(str(m["steady_recompiles"][way]) for way in WAYS),
            ]
        )

    print("\n## Workloads\n")
    header = ["workload", "what", "trained params", "N", "batch", "epochs", "steps"]
    print(table([*header, "optimizer"], what_rows))
    print("\n## Steady state: µs per step (medians over repeats), eqfit against the scans\n")
    print(
        f"(ratios of medians, the median of paired ratios in brackets; target ≤ {TARGET}; "
        "floor = the scan with eqfit's shuffle and gather)\n"
    )
    header = ["workload", "steps", "eqfit µs", "scan µs", "floor µs", "eqfit/scan"]
    print(table([*header, "eqfit/floor", f"≤ {TARGET}"], rows))
    print("\n## Spread of runs, first calls (compile included), compiles in timed calls\n")
    header = ["workload", "eqfit ms per run", "scan ms per run", "floor ms per run"]
    print(
        table([*header, "first s (eqfit scan floor)", "compiles timed (same order)"], spread_rows)
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke test: 2 repeats, a quarter of the epochs"
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {WORKLOADS}"
    )
    parser.add_argument(
        "--given-batches",
        action="store_true",
        help="also eqfit against the DQN floor on minibatches drawn beforehand",
    )
    parser.add_argument(
        "--guards",
        action="store_true",
        help="also eqfit with the NaN guard's `cond` against without (`guard=False`)",
    )
    default_out = Path(__file__).parent / "results" / "small_steps.json"
    parser.add_argument("--out", type=Path, default=default_out, help="JSON output path")
    args = parser.parse_args()
    names = [n for n in args.workloads.split(",") if n]
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {WORKLOADS}")
    repeats = 2 if args.quick else args.repeats
    inner = 1 if args.quick else 3  # back-to-back runs per sample (median)

    start = time.perf_counter()
    load_before = load_average()
    events = CompileEvents()
    workloads = make_workloads(names, args.quick)
    measured = {}
    for w in workloads:
        print(f"{w.name}: first calls, warm-up, {repeats} repeats...", file=sys.stderr)
        measured[w.name] = measure(w, repeats, inner, events)

    cfg = {
        **config(),
        "repeats": repeats,
        "inner_runs_per_sample": inner,
        "workloads": names,
        "quick": args.quick,
    }
    print("\n# small_steps\n")
    print(
        f"JAX {cfg['jax']} on {cfg['device']} ({cfg['cpu_count']} CPUs); eqfit from "
        f"{cfg['eqfit_path']}; repeats={repeats} (each the median of {inner} runs), "
        "the three ways interleaved in one process"
    )
    results: dict[str, Any] = {"workloads": report(workloads, measured)}
    if args.given_batches:
        print("given batches: first calls, warm-up, repeats...", file=sys.stderr)
        results["given_batches"] = measure_given(repeats, inner, events)
    if args.guards:
        print("guards: first calls, warm-up, repeats...", file=sys.stderr)
        results["guards"] = measure_guards(workloads, repeats, inner, events)
    results["config"] = cfg
    finish(args.out, results, start, load_before)


if __name__ == "__main__":
    main()
