"""The compiled program and its build: `fit`'s arguments checked (`_options`), the run's
schedule, its hashable description (`_loop`) built from the model (`_build`), the
training state's types, the placement on devices, the compiled run (`_program`) and
what the drive calls (`_calls`), with the cache of compiled programs. Imports `_core` and
`_step`, nothing above.
"""
