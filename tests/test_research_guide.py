"""Every code block of `docs/guides/research.md` runs as written, on the models it names
(Equinox's DCGAN with BatchNorm, convolutions, `eqx.nn.MLP`s): each block gets the names
it uses from a setup of its own below, runs, and its result is checked. A block with no
setup here fails the test, so a new block is run too.
"""

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqfit


ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "research.md"
BLOCKS = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.DOTALL)
KEY = jax.random.key(0)
RNG = np.random.default_rng(0)


def common() -> dict[str, Any]:
    return dict(eqx=eqx, eqfit=eqfit, jax=jax, jnp=jnp, np=np, optax=optax, key=KEY)


def regression(n=64) -> tuple[np.ndarray, np.ndarray]:
    x = RNG.normal(size=(n, 3)).astype(np.float32)
    return x, x.sum(1, keepdims=True).astype(np.float32)


def dcgan() -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("gan_example", ROOT / "examples" / "gan.py")
    assert spec is not None and spec.loader is not None
    gan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gan)
    names = ("Generator", "Discriminator", "LATENT", "batched", "cross_entropy")
    return {n: getattr(gan, n) for n in names} | {"images": gan.digits()[:64]}


def check_dcgan(ns: dict[str, Any]) -> None:
    h = ns["result"].history
    assert h.epochs == 10 and np.isfinite(h["d_loss"]).all() and np.isfinite(h["g_loss"]).all()
    assert set(ns["result"].opt_state) == {"d", "g"}


class Generator(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, key):
        self.linear = eqx.nn.Linear(4, 64, key=key)

    def __call__(self, z):
        return jnp.tanh(self.linear(z)).reshape(1, 8, 8)


class Critic(eqx.Module):
    conv: eqx.nn.Conv2d
    linear: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 4, 3, padding=1, key=k1)
        self.linear = eqx.nn.Linear(4 * 64, 1, key=k2)

    def __call__(self, x):
        return self.linear(jax.nn.leaky_relu(self.conv(x)).reshape(-1))


class WGAN(eqx.Module):
    generator: Generator
    critic: Critic


def wgan() -> dict[str, Any]:
    k1, k2 = jax.random.split(KEY)
    images = np.tanh(RNG.normal(size=(32, 1, 8, 8))).astype(np.float32)
    return {"wgan": WGAN(Generator(k1), Critic(k2)), "images": images, "LATENT": 4}


def check_wgan(ns: dict[str, Any]) -> None:
    h = ns["result"].history
    assert h.epochs == 100 and np.isfinite(h["critic_distance"]).all()
    # The generator ran on steps 5, 10, ...: one epoch of one step in five.
    assert np.isfinite(h["generator_loss"]).sum() == 20


class Agent(eqx.Module):
    online: eqx.nn.MLP
    target: eqx.nn.MLP


def polyak() -> dict[str, Any]:
    k1, k2 = jax.random.split(KEY)
    agent = Agent(eqx.nn.MLP(3, 1, 8, 1, key=k1), eqx.nn.MLP(3, 1, 8, 1, key=k2))

    def td_loss(agent, x, y):
        return jnp.mean((jax.vmap(agent.online)(x) - y) ** 2)

    return {"agent": agent, "data": regression(), "td_loss": td_loss, "Callable": Callable}


def check_polyak(ns: dict[str, Any]) -> None:
    result, agent = ns["result"], ns["agent"]
    lag = result.history["target_lag"]
    assert lag.shape == (1,) and np.isfinite(lag).all()
    # The target moved towards the online network and nowhere else: its activation is
    # still the MLP's, its weights changed.
    moved = jax.tree.leaves(eqx.filter(result.model.target, eqx.is_inexact_array))
    before = jax.tree.leaves(eqx.filter(agent.target, eqx.is_inexact_array))
    assert any(not np.array_equal(a, b) for a, b in zip(moved, before))
    assert result.model.target.activation is agent.target.activation


def hand_loop() -> dict[str, Any]:
    x, y = regression()
    return {"loss": eqfit.losses.mse, "model": eqfit.models.MLP(3, 1, 8, 1, key=KEY), "xy": (x, y)}


def check_hand_loop(ns: dict[str, Any]) -> None:
    model, state = ns["model"], ns["state"]
    model, state, values = ns["step"](model, state, ns["xy"])
    assert set(values) == {"loss"} and np.isfinite(values["loss"])


class Tagger(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(self.linear)(x)


def weighted() -> dict[str, Any]:
    x = RNG.normal(size=(64, 5, 3)).astype(np.float32)
    y = RNG.integers(0, 4, size=(64, 5)).astype(np.int32)
    mask = np.arange(5)[None] < RNG.integers(1, 6, size=64)[:, None]
    return {"model": Tagger(eqx.nn.Linear(3, 4, key=KEY)), "x": x, "y": y, "mask": mask}


def check_weighted(ns: dict[str, Any]) -> None:
    h = ns["result"].history
    assert np.isfinite(h.loss).all() and np.isfinite(h["acc"]).all()


def sam() -> dict[str, Any]:
    x, y = regression()
    return {"model": eqfit.models.MLP(3, 1, 8, 1, key=KEY), "x": x, "y": y}


def check_sam(ns: dict[str, Any]) -> None:
    assert np.isfinite(ns["result"].history.loss).all()


def distillation() -> dict[str, Any]:
    k1, k2 = jax.random.split(KEY)
    x = RNG.normal(size=(64, 3)).astype(np.float32)
    y = RNG.integers(0, 4, size=64).astype(np.int32)
    teacher = eqx.nn.Sequential(
        [
            eqx.nn.Linear(3, 8, key=k1),
            eqx.nn.Dropout(0.1),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Linear(8, 4, key=k2),
        ]
    )
    return {"teacher": teacher, "student": eqx.nn.MLP(3, 4, 8, 1, key=k2), "x": x, "y": y}


def check_distillation(ns: dict[str, Any]) -> None:
    result = ns["result"]
    assert np.isfinite(result.history["soft"]).all()
    for a, b in zip(jax.tree.leaves(result.model.teacher), jax.tree.leaves(ns["teacher"])):
        if eqx.is_array(a):
            np.testing.assert_array_equal(a, b)  # the teacher does not move


def ppo() -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("ppo_example", ROOT / "examples" / "ppo.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    network = example.networks(jax.random.key(1))
    return {"start": example.start, "ppo_iteration": example.ppo_iteration, "network": network}


def check_ppo(ns: dict[str, Any]) -> None:
    returns = ns["result"].history["ppo_return"]
    assert returns.shape == (8,) and returns[-1] >= 400, returns


# Each block by a line of its own: its setup and its check.
SETUPS: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]] = {
    "class GAN(eqx.Module):": (dcgan, check_dcgan),
    "def critic_loss(wgan, images, *, key):": (wgan, check_wgan),
    "class Polyak(eqfit.AbstractUpdate):": (polyak, check_polyak),
    "def step(model, state, batch):": (hand_loop, check_hand_loop),
    "def loss(model, x, y, mask):": (weighted, check_weighted),
    "class PPO(eqfit.AbstractUpdate):": (ppo, check_ppo),
    "optimizer = optax.contrib.sam(": (sam, check_sam),
    "class Distilled(eqx.Module):": (distillation, check_distillation),
}
# The DCGAN's convolutions compile for seconds; PPO trains for its 976 iterations.
HEAVY = ("class GAN(eqx.Module):", "class PPO(eqfit.AbstractUpdate):")


def setup_of(block: str) -> str:
    found = [line for line in SETUPS if line in block]
    assert len(found) == 1, f"a block of the research guide has no setup here:\n{block}"
    return found[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "block",
    [
        pytest.param(b, marks=[pytest.mark.heavy] if setup_of(b) in HEAVY else [], id=setup_of(b))
        for b in BLOCKS
    ],
)
def test_each_block_of_the_research_guide_runs_as_written(block):
    setup, check = SETUPS[setup_of(block)]
    ns = common() | setup()
    exec(compile(block, str(GUIDE), "exec"), ns)
    check(ns)


def test_every_block_has_a_setup():
    assert len(BLOCKS) == len(SETUPS) == len({setup_of(b) for b in BLOCKS})
