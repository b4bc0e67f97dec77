"""What is kept: the checkpoint directory (`_checkpoint`), its files, Orbax's sharded
checkpoints, resuming from them, and what identifies a run for them (`_identity`).
Imports `_core`, `_step` and `_program`, nothing above.
"""
