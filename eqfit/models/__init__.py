"""Ready models: plain `eqx.Module`s, each called on one example."""

from ._cnn import CNN as CNN
from ._linear import LinearRegression as LinearRegression
from ._mlp import MLP as MLP
