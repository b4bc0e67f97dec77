"""The training step and what it calls: the user's loss and metrics (`_objective`), a
loss's gradient step (`_descent`), updates (`_updates`), weighted means, precision, the
average, microbatches, the record of what a step reports (`_record`), and the step
itself (`_step`). Imports `_core` below it, nothing above.
"""
