"""What every layer speaks: the types of `fit`'s arguments, the runtime checks and their
messages, the data's description and shuffle, eqfit's version, and the option objects a
user builds (`EarlyStopping`, `Checkpoint`, `Profile`, `Execution`). Imports nothing of
eqfit's but its own modules.
"""
