"""PureJaxRL's PPO on gymnax's CartPole-v1, trained by `eqfit.fit` with no dataset: each
step of the run is one PPO iteration (a rollout of 4 environments for 128 steps, then 4
epochs of 4 minibatches of updates), run by an update of our own.

PureJaxRL (`purejaxrl/ppo.py`, Lu et al., "Discovered Policy Optimisation", 2022) showed
that reinforcement learning is fastest when everything, the environments included, is one
compiled program. Here its algorithm is written line for line (its Flax network in
Equinox): `ppo_iteration` is PureJaxRL's `_update_step`, and `PPO`, an
`eqfit.AbstractUpdate`, runs it in `fit`'s step, its state carrying the optimizer's state,
the environments' states, their last observations and the key. `fit` adds what a
hand-written `jit(lax.scan)` lacks: a log, checkpoints that resume bit for bit, several
seeds at once as an ensemble, and the episodic return as a weighted mean (the returns of
the episodes that ended over their number) in the history.

`benchmarks/ppo.py` times this run against the same iterations as one hand-written
`jit(lax.scan)`, PureJaxRL's form, and checks that they give the same returns.

Run: `pip install -e ".[rl]" && python examples/ppo.py [--seeds 4] [--checkpoint DIR]`
"""

import argparse
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

import eqfit


# PureJaxRL's configuration for CartPole-v1.
LR = 2.5e-4
NUM_ENVS = 4
NUM_STEPS = 128
TOTAL_TIMESTEPS = 500_000
UPDATE_EPOCHS = 4
NUM_MINIBATCHES = 4
GAMMA = 0.99
GAE_LAMBDA = 0.95
CLIP_EPS = 0.2
ENT_COEF = 0.01
VF_COEF = 0.5
MAX_GRAD_NORM = 0.5
NUM_UPDATES = TOTAL_TIMESTEPS // NUM_STEPS // NUM_ENVS  # 976 iterations
MINIBATCH_SIZE = NUM_ENVS * NUM_STEPS // NUM_MINIBATCHES


def dense(n_in: int, n_out: int, scale: float, key: PRNGKeyArray) -> eqx.nn.Linear:
    """Flax's `Dense` as PureJaxRL initialises it: an orthogonal kernel of gain `scale`
    (drawn as Flax draws its `(in, out)` kernel), a zero bias."""
    layer = eqx.nn.Linear(n_in, n_out, key=key)
    kernel = jax.nn.initializers.orthogonal(scale)(key, (n_in, n_out), jnp.float32)
    layer = eqx.tree_at(lambda m: m.weight, layer, kernel.T)
    return eqx.tree_at(lambda m: m.bias, layer, jnp.zeros(n_out))


class ActorCritic(eqx.Module):
    """PureJaxRL's `ActorCritic`: two tanh MLPs of 64 units, the policy's logits and the
    value, on one observation."""

    actor: list[eqx.nn.Linear]
    critic: list[eqx.nn.Linear]

    def __init__(self, obs_size: int, actions: int, key: PRNGKeyArray):
        k = jax.random.split(key, 6)
        root2 = float(np.sqrt(2))
        self.actor = [
            dense(obs_size, 64, root2, k[0]),
            dense(64, 64, root2, k[1]),
            dense(64, actions, 0.01, k[2]),
        ]
        self.critic = [
            dense(obs_size, 64, root2, k[3]),
            dense(64, 64, root2, k[4]),
            dense(64, 1, 1.0, k[5]),
        ]

    def __call__(self, obs: Float[Array, " obs"]) -> tuple[Float[Array, " actions"], Array]:
        logits, value = obs, obs
        for layer in self.actor[:-1]:
            logits = jnp.tanh(layer(logits))
        for layer in self.critic[:-1]:
            value = jnp.tanh(layer(value))
        return self.actor[-1](logits), jnp.squeeze(self.critic[-1](value), -1)


def log_prob(logits: Array, action: Array) -> Array:
    """distrax's `Categorical(logits).log_prob`."""
    return jnp.take_along_axis(jax.nn.log_softmax(logits), action[..., None], -1)[..., 0]


def entropy(logits: Array) -> Array:
    """distrax's `Categorical(logits).entropy`."""
    logp = jax.nn.log_softmax(logits)
    return -jnp.sum(jnp.exp(logp) * logp, -1)


class Logged(NamedTuple):
    """PureJaxRL's `LogWrapper`'s state: an environment's, and its episode's return so far."""

    env_state: Any
    episode_return: Float[Array, ""]


class Transition(NamedTuple):
    done: Array
    action: Array
    value: Array
    reward: Array
    log_prob: Array
    obs: Array
    returned: Array  # the episode's return, where it ended at this step


class Runner(NamedTuple):
    """What PPO carries from iteration to iteration besides the network."""

    opt_state: Any
    env_state: Logged
    last_obs: Array
    rng: PRNGKeyArray


def linear_schedule(count: ArrayLike) -> Float[Array, ""]:
    """PureJaxRL's annealed learning rate, by the count of minibatch updates."""
    frac = 1.0 - (jnp.asarray(count) // (NUM_MINIBATCHES * UPDATE_EPOCHS)) / NUM_UPDATES
    return LR * frac


def optimizer() -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(MAX_GRAD_NORM),
        optax.adam(learning_rate=linear_schedule, eps=1e-5),
    )


ENV, ENV_PARAMS = gymnax.make("CartPole-v1")
TX = optimizer()


def start(params: Any, key: PRNGKeyArray) -> Runner:
    """PureJaxRL's `train` up to its scan: the optimizer's state for the network's arrays
    (`params`, as `eqx.filter` gives them), the environments reset."""
    key, reset_key = jax.random.split(key)
    obs, env_state = jax.vmap(ENV.reset, in_axes=(0, None))(
        jax.random.split(reset_key, NUM_ENVS), ENV_PARAMS
    )
    logged = Logged(env_state, jnp.zeros(NUM_ENVS))
    return Runner(TX.init(params), logged, obs, key)


def ppo_iteration(
    network: ActorCritic, runner: Runner
) -> tuple[ActorCritic, Runner, dict[str, Array]]:
    """PureJaxRL's `_update_step`: a rollout, the advantages, and the epochs of minibatch
    updates. Returns the network and runner after it, and its figures: the sum and the
    number of the returns of the episodes that ended, and the mean loss."""
    params, static = eqx.partition(network, eqx.is_inexact_array)

    def policy(params: Any, obs: Array) -> tuple[Array, Array]:
        return jax.vmap(eqx.combine(params, static))(obs)

    def env_step(runner: Runner, _: None) -> tuple[Runner, Transition]:
        opt_state, logged, last_obs, rng = runner
        rng, key = jax.random.split(rng)
        logits, value = policy(params, last_obs)
        action = jax.random.categorical(key, logits)
        rng, key = jax.random.split(rng)
        obs, env_state, reward, terminated, truncated, _ = jax.vmap(
            ENV.step, in_axes=(0, 0, 0, None)
        )(jax.random.split(key, NUM_ENVS), logged.env_state, action, ENV_PARAMS)
        done = terminated | truncated
        episode_return = logged.episode_return + reward
        returned = jnp.where(done, episode_return, jnp.nan)
        logged = Logged(env_state, episode_return * (1 - done))
        transition = Transition(
            done, action, value, reward, log_prob(logits, action), last_obs, returned
        )
        return Runner(opt_state, logged, obs, rng), transition

    runner, traj = jax.lax.scan(env_step, runner, None, NUM_STEPS)
    _, last_val = policy(params, runner.last_obs)

    def advantage(carry: tuple[Array, Array], t: Transition) -> tuple[Any, Array]:
        gae, next_value = carry
        delta = t.reward + GAMMA * next_value * (1 - t.done) - t.value
        gae = delta + GAMMA * GAE_LAMBDA * (1 - t.done) * gae
        return (gae, t.value), gae

    _, advantages = jax.lax.scan(
        advantage, (jnp.zeros_like(last_val), last_val), traj, reverse=True, unroll=16
    )
    targets = advantages + traj.value

    def loss_fn(params: Any, traj: Transition, gae: Array, targets: Array) -> Any:
        logits, value = policy(params, traj.obs)
        new_log_prob = log_prob(logits, traj.action)
        clipped = traj.value + (value - traj.value).clip(-CLIP_EPS, CLIP_EPS)
        value_loss = 0.5 * jnp.maximum((value - targets) ** 2, (clipped - targets) ** 2).mean()
        ratio = jnp.exp(new_log_prob - traj.log_prob)
        gae = (gae - gae.mean()) / (gae.std() + 1e-8)
        actor = -jnp.minimum(ratio * gae, jnp.clip(ratio, 1 - CLIP_EPS, 1 + CLIP_EPS) * gae)
        total = actor.mean() + VF_COEF * value_loss - ENT_COEF * entropy(logits).mean()
        return total

    def minibatch(carry: tuple[Any, Any], batch: Any) -> tuple[Any, Array]:
        params, opt_state = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = TX.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    def epoch(carry: tuple[Any, Any, PRNGKeyArray], _: None) -> tuple[Any, Array]:
        params, opt_state, rng = carry
        rng, key = jax.random.split(rng)
        size = MINIBATCH_SIZE * NUM_MINIBATCHES
        permutation = jax.random.permutation(key, size)
        batch = jax.tree.map(lambda x: x.reshape((size, *x.shape[2:])), (traj, advantages, targets))
        shuffled = jax.tree.map(lambda x: jnp.take(x, permutation, axis=0), batch)
        minibatches = jax.tree.map(
            lambda x: x.reshape((NUM_MINIBATCHES, -1, *x.shape[1:])), shuffled
        )
        (params, opt_state), losses = jax.lax.scan(minibatch, (params, opt_state), minibatches)
        return (params, opt_state, rng), losses

    (params, opt_state, rng), losses = jax.lax.scan(
        epoch, (params, runner.opt_state, runner.rng), None, UPDATE_EPOCHS
    )
    ended = ~jnp.isnan(traj.returned)
    figures = {
        "returns": jnp.sum(jnp.where(ended, traj.returned, 0.0)),
        "episodes": jnp.sum(ended).astype(jnp.float32),
        "loss": jnp.mean(losses),
    }
    runner = runner._replace(opt_state=opt_state, rng=rng)
    return eqx.combine(params, static), runner, figures


class PPO(eqfit.AbstractUpdate):
    """One PPO iteration a step: `ppo_iteration` on the network `fit` trains, its runner
    in the update's state (and so in `result.opt_state["ppo"]` and the checkpoints)."""

    name: str = "ppo"

    def init(self, params: Any, *, key: PRNGKeyArray | None = None) -> Runner:
        assert key is not None  # `fit` gives each update (and ensemble member) its own
        return start(params, key)

    def apply(
        self, model: ActorCritic, state: Runner, batch: None, *, model_state: Any, key: Any
    ) -> eqfit.Applied:
        network, runner, figures = ppo_iteration(model, state)
        values = {
            "return": eqfit.Mean(figures["returns"], figures["episodes"]),
            "loss": figures["loss"],
        }
        return eqfit.Applied(network, runner, model_state, values)


def networks(keys: PRNGKeyArray) -> ActorCritic:
    """One network per key, stacked (an ensemble) for several keys."""
    obs_size = ENV.observation_space(ENV_PARAMS).shape[0]
    actions = ENV.action_space(ENV_PARAMS).n
    if keys.ndim == 0:
        return ActorCritic(obs_size, actions, keys)
    return eqx.filter_vmap(lambda k: ActorCritic(obs_size, actions, k))(keys)


def train(
    seeds: int = 1,
    epochs: int = 8,
    progress: bool | str = False,
    checkpoint: str | None = None,
    seed: int = 0,
    steps_per_epoch: int | None = None,
    make: Callable[..., Any] = eqfit.fit,
) -> eqfit.FitResult[ActorCritic]:
    """PPO for `TOTAL_TIMESTEPS` environment steps, in `epochs` epochs of iterations (or
    `steps_per_epoch` iterations each); `seeds` runs at once as an ensemble (member `m`
    as the single run with key `jax.random.split(key, seeds)[m]` and its network). `make`
    is `eqfit.fit`, or `eqfit.plan` to compile the run without training."""
    key = jax.random.key(seed)
    network_key, key = jax.random.split(key)
    if seeds == 1:
        model = networks(network_key)
    else:
        model = networks(jax.random.split(network_key, seeds))
    return make(
        model,
        # Each step's samples: the rollout's environment steps, for samples per second.
        updates=[PPO(samples=NUM_ENVS * NUM_STEPS)],
        steps_per_epoch=steps_per_epoch or NUM_UPDATES // epochs,
        epochs=epochs,
        key=key,
        ensemble=seeds > 1,
        progress=progress,
        checkpoint=checkpoint,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4, help="runs at once, as an ensemble")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--checkpoint", default=None, help="a directory to resume from")
    args = parser.parse_args()
    began = time.perf_counter()
    result = train(args.seeds, args.epochs, progress="lines", checkpoint=args.checkpoint)
    returns = np.atleast_2d(result.history["ppo_return"].T).T  # (epochs, seeds)
    for epoch, row in zip(result.history.epoch, returns):
        print(
            f"epoch {epoch}: mean episodic return {np.nanmean(row):6.1f}  per seed {row.round(1)}"
        )
    steps = len(result.history.epoch) * (NUM_UPDATES // args.epochs) * NUM_ENVS * NUM_STEPS
    print(
        f"{steps:,} environment steps a seed, {args.seeds} seed(s), in "
        f"{time.perf_counter() - began:.1f} s; final mean return {np.nanmean(returns[-1]):.1f}"
    )


if __name__ == "__main__":
    main()
