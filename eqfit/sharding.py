"""The layout of a model's arrays over a mesh of devices, for models larger than one
device.

`shard=` takes a rule, which gives each array of the model its
`jax.sharding.PartitionSpec`:

- `fsdp(axis)`: each array split along its largest dimension over one mesh axis;
- `rules((pattern, spec), ..., default=...)`: specs chosen by regular expressions over
    the arrays' paths (`.layers[0].weight`), as Keras's `LayoutMap`;
- a function `(path, leaf) -> PartitionSpec | None`, given each array's path and its
    `jax.ShapeDtypeStruct`;
- a PyTree of `PartitionSpec | None` that is a prefix of the model, as
    `eqx.filter_shard` takes.

`None` replicates an array. `init` builds a model already laid out, and
`bytes_per_device` says how much of it each device holds.
"""

from ._program._sharding import (
    bytes_per_device as bytes_per_device,
    FSDP as FSDP,
    fsdp as fsdp,
    init as init,
    Rules as Rules,
    rules as rules,
    Shard as Shard,
)
