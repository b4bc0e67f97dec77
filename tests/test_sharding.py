"""`eqfit.sharding`: layout rules, their resolution and checks, `init` and `bytes_per_device`."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import programs_made
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import eqfit
from eqfit._program._sharding import resolve, shardings
from eqfit.sharding import bytes_per_device, fsdp, init, rules


def mesh8():
    return Mesh(np.array(jax.devices()), ("data",), axis_types=(AxisType.Auto,))


def mesh2x4():
    devices = np.array(jax.devices()).reshape(2, 4)
    return Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto,) * 2)


# Shapes only: resolving a layout reads shapes and paths, so the tests need no arrays.
# Its arrays are .layers[0].weight (1024, 64), .layers[0].bias (1024,),
# .layers[1].weight (1024, 1024), .layers[1].bias (1024,), .layers[2].weight (1, 1024)
# and .layers[2].bias (1,); `activation` and `final_activation` are functions.
MLP = eqx.filter_eval_shape(eqx.nn.MLP, 64, 1, 1024, 2, key=jax.random.key(0))


def specs(model, mesh, shard):
    """{path: spec} for each array of `model`."""
    resolved = resolve(model, mesh, shard)
    flat = jax.tree_util.tree_flatten_with_path(resolved, is_leaf=lambda x: isinstance(x, P))[0]
    return {jax.tree_util.keystr(path): spec for path, spec in flat}


def test_fsdp_splits_the_largest_dimension():
    assert specs(MLP, mesh8(), fsdp("data")) == {
        ".layers[0].weight": P("data"),  # 1024 of (1024, 64)
        ".layers[0].bias": P(),  # 4 KiB: under min_bytes
        ".layers[1].weight": P("data"),  # (1024, 1024): of equal dimensions, the first
        ".layers[1].bias": P(),
        ".layers[2].weight": P(),
        ".layers[2].bias": P(),
    }
    assert specs(MLP, mesh8(), fsdp("data", min_bytes=0)) == {
        ".layers[0].weight": P("data"),
        ".layers[0].bias": P("data"),
        ".layers[1].weight": P("data"),
        ".layers[1].bias": P("data"),
        ".layers[2].weight": P(None, "data"),  # (1, 1024): 8 does not divide 1
        ".layers[2].bias": P(),  # (1,): no dimension 8 divides
    }


def test_fsdp_over_one_axis_or_several_of_a_2d_mesh():
    assert specs(MLP, mesh2x4(), fsdp("model", min_bytes=0))[".layers[2].weight"] == P(
        None, "model"
    )
    both = specs(MLP, mesh2x4(), fsdp(("data", "model")))
    assert both[".layers[1].weight"] == P(("data", "model"))
    assert both[".layers[1].bias"] == P()
    # Only the dimension of 12 splits over 4; of (8, 12), neither splits over 8.
    tree = {"a": jax.ShapeDtypeStruct((8, 12, 3), jnp.float32)}
    assert specs(tree, mesh2x4(), fsdp("model", min_bytes=0)) == {"['a']": P(None, "model")}
    assert specs(tree, mesh8(), fsdp(min_bytes=0)) == {"['a']": P("data")}
    assert specs({"a": jnp.zeros((3, 5))}, mesh8(), fsdp(min_bytes=0)) == {"['a']": P()}


def test_rules_by_path_with_a_default():
    shard = rules(
        (r"^\.layers\[1\]\.weight$", P("model", "data")),
        (r"\.bias$", None),
        default=fsdp("model", min_bytes=0),
    )
    assert specs(MLP, mesh2x4(), shard) == {
        ".layers[0].weight": P("model"),
        ".layers[0].bias": P(),
        ".layers[1].weight": P("model", "data"),
        ".layers[1].bias": P(),
        ".layers[2].weight": P(None, "model"),
        ".layers[2].bias": P(),
    }
    # No default: replicated. A rule's layout may be a rule too.
    shard = rules((r"^\.layers\[0\]", fsdp("data", min_bytes=0)), (r"1\]\.weight", P("model")))
    assert specs(MLP, mesh2x4(), shard) == {
        ".layers[0].weight": P("data"),
        ".layers[0].bias": P("data"),
        ".layers[1].weight": P("model"),
        ".layers[1].bias": P(),
        ".layers[2].weight": P(),
        ".layers[2].bias": P(),
    }
    assert specs(MLP, mesh2x4(), rules(default=fsdp("model"))) == specs(
        MLP, mesh2x4(), fsdp("model")
    )


def test_a_function_gets_each_path_and_shape():
    seen = {}

    def by_shape(path, leaf):
        seen[path] = leaf
        return P(None, "model") if leaf.ndim == 2 and leaf.shape[1] % 4 == 0 else None

    assert specs(MLP, mesh2x4(), by_shape) == {
        ".layers[0].weight": P(None, "model"),
        ".layers[0].bias": P(),
        ".layers[1].weight": P(None, "model"),
        ".layers[1].bias": P(),
        ".layers[2].weight": P(None, "model"),
        ".layers[2].bias": P(),
    }
    assert seen[".layers[0].weight"] == jax.ShapeDtypeStruct((1024, 64), jnp.float32)


def test_a_prefix_pytree_of_specs():
    # As eqx.filter_shard takes it: P() at every leaf, then one spec changed, one layer's
    # subtree replaced by a single spec.
    shard = jax.tree.map(lambda _: P(), MLP)
    shard = eqx.tree_at(lambda m: m.layers[1].weight, shard, P(None, "model"))
    shard = eqx.tree_at(lambda m: m.layers[0], shard, P("data"))
    assert specs(MLP, mesh2x4(), shard) == {
        ".layers[0].weight": P("data"),
        ".layers[0].bias": P("data"),
        ".layers[1].weight": P(None, "model"),
        ".layers[1].bias": P(),
        ".layers[2].weight": P(),
        ".layers[2].bias": P(),
    }
    tree = {"a": jnp.zeros((8, 2)), "b": {"c": jnp.zeros(4), "d": jnp.zeros(4)}}
    assert specs(tree, mesh2x4(), {"a": P("data"), "b": None}) == {
        "['a']": P("data"),
        "['b']['c']": P(),
        "['b']['d']": P(),
    }
    assert specs(tree, mesh2x4(), P()) == specs(tree, mesh2x4(), None)


def test_resolve_keeps_the_structure_and_shardings_give_named_shardings():
    resolved = resolve(MLP, mesh8(), fsdp())
    assert resolved.activation is None and resolved.final_activation is None
    assert resolved.layers[1].weight == P("data")
    # An explicit mesh (jax.make_mesh's kind) is made "auto", as fit makes it.
    explicit = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    placed = shardings(MLP, explicit, fsdp())
    assert placed.layers[1].weight == NamedSharding(mesh8(), P("data"))
    assert placed.layers[1].weight.mesh.axis_types == (AxisType.Auto,)


def test_rules_are_hashable_comparable_and_readable():
    assert fsdp() == fsdp("data", min_bytes=2**14) and hash(fsdp()) == hash(fsdp())
    assert fsdp("data") != fsdp("model")
    assert repr(fsdp()) == "fsdp(axis='data', min_bytes=16384)"
    make = lambda: rules((r"\.weight$", P(None, "model")), default=fsdp())  # noqa: E731
    assert make() == make() and hash(make()) == hash(make())
    assert make() != rules((r"\.weight$", P("model")), default=fsdp())
    assert repr(make()) == (
        r"rules(('\\.weight$', P(None, 'model')), default=fsdp(axis='data', min_bytes=16384))"
    )
    with pytest.raises(AttributeError):
        make().default = None  # pyright: ignore


# Errors: each names the array's path, its shape and the rule.


def test_error_unknown_axis():
    message = (
        "`shard`: the layout P('model',) lays out `.layers[0].weight` (shape (1024, 64)) as "
        "P('model',), but the mesh has no axis 'model' (its axes are {'data': 8})."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve(MLP, mesh8(), P("model"))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`shard`: fsdp(axis='model', min_bytes=16384) lays out `.layers[0].weight` "
            "(shape (1024, 64)) over the mesh axis 'model', but the mesh has no axis 'model'"
        ),
    ):
        resolve(MLP, mesh8(), fsdp("model"))


def test_error_axis_does_not_divide():
    shard = rules((r"^\.layers\[2\]\.weight$", P(None, "model")), (r"2\]\.bias", P("data")))
    tree = eqx.tree_at(lambda m: m.layers[2].weight, MLP, jax.ShapeDtypeStruct((1, 6), "f4"))
    message = (
        r"`shard`: the rule ('^\\.layers\\[2\\]\\.weight$', P(None, 'model')) lays out "
        "`.layers[2].weight` (shape (1, 6)) as P(None, 'model'), but dimension 1 (of size 6) "
        "does not split evenly over the 4 devices of the mesh axis 'model'."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve(tree, mesh2x4(), shard)
    with pytest.raises(ValueError, match=r"the 8 devices of the mesh axes \('data', 'model'\)"):
        resolve({"a": jnp.zeros(4)}, mesh2x4(), P(("data", "model")))


def test_error_more_entries_than_dimensions():
    shard = rules((r"bias", P(None, "data")))
    message = (
        r"`shard`: the rule ('bias', P(None, 'data')) lays out `.layers[0].bias` (shape "
        r"(1024,)) as P(None, 'data'), but the array has 1 dimensions, fewer than the "
        "layout's 2 entries."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve(MLP, mesh2x4(), shard)


def test_error_one_axis_for_two_dimensions():
    with pytest.raises(ValueError, match=r"`\['a'\]` \(shape \(8, 8\)\) as P\('data', 'data'\), "):
        resolve({"a": jnp.zeros((8, 8))}, mesh2x4(), P("data", "data"))


def test_error_two_patterns_match():
    shard = rules((r"weight", P("data")), (r"layers\[1\]", None), default=fsdp())
    message = (
        r"`shard`: the rules ('weight', P('data',)) and ('layers\\[1\\]', None) both match "
        "`.layers[1].weight` (shape (1024, 1024)); a path may match one rule at most"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve(MLP, mesh8(), shard)


def test_error_not_a_prefix():
    tree = {"a": jnp.zeros((8, 2)), "b": {"c": jnp.zeros(4)}}
    message = (
        "`shard` is not a prefix of the model: at its root it holds a dict with children "
        "['a'], ['x'], where the model holds a dict with children ['a'], ['b'] (its arrays "
        "start with `['a']`, of shape (8, 2)); `shard` must hold a PyTree that is a prefix "
        "of the model there."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve(tree, mesh8(), {"a": P(), "x": None})
    message = (
        "`shard` is not a prefix of the model: at `['a']` it holds a dict with children "
        "['z'], where the model holds an array of shape (8, 2) (its arrays start with "
        "`['a']`, of shape (8, 2))"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve(tree, mesh8(), {"a": {"z": P()}, "b": None})
    # The model itself, arrays where specs belong.
    with pytest.raises(ValueError, match=r"at `\['a'\]` it holds an array of shape \(8, 2\)"):
        resolve(tree, mesh8(), tree)
    # A prefix's spec is checked as any other, and named with where it was given.
    with pytest.raises(
        ValueError, match=re.escape("the layout P('model',) that `shard` gives at `['b']` lays")
    ):
        resolve(tree, mesh8(), {"a": None, "b": P("model")})


def test_error_function_returns_something_else():
    def as_tuple(path, leaf):
        return ("data",)

    message = (
        "`shard`: the function `test_error_function_returns_something_else.<locals>.as_tuple` "
        "returned ('data',) for `.layers[0].weight` (shape (1024, 64)), where a "
        "`jax.sharding.PartitionSpec` (or `None`, to replicate the array) was expected."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve(MLP, mesh8(), as_tuple)


def test_error_bad_arguments_to_the_rules():
    with pytest.raises(ValueError, match=r"`rules`: the pattern '\(' is not a regular expression"):
        rules(("(", P()))
    with pytest.raises(ValueError, match="`fsdp`'s `min_bytes` must be at least 0, got -1"):
        fsdp(min_bytes=-1)


# init and bytes_per_device.


def arrays(model):
    return jax.tree.leaves(eqx.filter(model, eqx.is_array))


@pytest.fixture(scope="module")
def fsdp_mlp():
    """A 64-1024-1024-1 MLP (4.5 MB, of which 12 KB, the biases and the last layer, is
    replicated under fsdp), built by `init` over 8 devices, and its key.
    """
    key = jax.random.key(3)
    return init(eqx.nn.MLP, 64, 1, 1024, 2, key=key, mesh=mesh8(), shard=fsdp()), key


def test_init_is_bit_for_bit_the_plain_build(fsdp_mlp):
    model, key = fsdp_mlp
    plain = eqx.nn.MLP(64, 1, 1024, 2, key=key)
    assert jax.tree.structure(model) == jax.tree.structure(plain)
    assert model.activation is plain.activation
    for a, b in zip(arrays(model), arrays(plain)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert model.layers[1].weight.sharding == NamedSharding(mesh8(), P("data"))
    assert model.layers[1].bias.sharding == NamedSharding(mesh8(), P())

    # A raw key, and a layout per path over a 2-D mesh.
    raw = jax.random.PRNGKey(5)
    shard = rules((r"weight", P("model", "data")))
    model = init(eqx.nn.Linear, 32, 16, key=raw, mesh=mesh2x4(), shard=shard)
    np.testing.assert_array_equal(model.weight, eqx.nn.Linear(32, 16, key=raw).weight)
    np.testing.assert_array_equal(model.bias, eqx.nn.Linear(32, 16, key=raw).bias)
    assert model.weight.sharding.spec == P("model", "data")
    assert model.weight.addressable_shards[0].data.shape == (4, 16)

    # A function with the key among its positional arguments.
    def make(key, width):
        return eqx.nn.Linear(width, width, key=key)

    model = init(make, key, 16, mesh=mesh8(), shard=fsdp(min_bytes=0))
    np.testing.assert_array_equal(model.weight, make(key, 16).weight)
    assert model.weight.sharding.spec == P("data")


def test_init_compiles_a_build_once():
    def build(width=8, key=jax.random.key(4)):
        return init(eqx.nn.Linear, 24, width, key=key, mesh=mesh8(), shard=fsdp(min_bytes=0))

    first = build()
    assert programs_made(build) == 0  # the same build: its program is kept
    again = build()
    np.testing.assert_array_equal(again.weight, first.weight)
    assert again.weight.sharding == first.weight.sharding
    # Another key (an array) reuses it too; another width (held fixed) does not.
    assert programs_made(lambda: build(key=jax.random.key(5))) == 0
    assert programs_made(lambda: build(width=16)) > 0
    eqfit.clear_cache()
    assert programs_made(build) > 0  # freed with `fit`'s programs


def test_init_checks_the_layout_before_building():
    calls = []

    def make(key):
        calls.append(key)
        return eqx.nn.Linear(8, 8, key=key)

    with pytest.raises(ValueError, match="the mesh has no axis 'model'"):
        init(make, jax.random.key(0), mesh=mesh8(), shard=P("model"))
    assert len(calls) == 1  # traced for its shapes, never compiled


def test_bytes_per_device_under_fsdp(fsdp_mlp):
    model, _ = fsdp_mlp
    total = sum(x.nbytes for x in arrays(model))
    held = bytes_per_device(model)
    assert set(held) == set(jax.devices())
    assert max(held.values()) <= total / 8 + 0.02 * total
    # Replicated, each device holds it all.
    whole = jax.device_put(jnp.zeros(100), NamedSharding(mesh8(), P()))
    assert bytes_per_device({"x": whole, "y": 3, "z": np.zeros(5)}) == {
        d: 400 for d in jax.devices()
    }
