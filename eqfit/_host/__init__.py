"""The host's side of a run: the data's sources and feeds, the drive that calls the
program (`_drive`), its observers (callbacks, checkpoints, throughput, the bar, profiles),
signals, waiting for the device, and the plan (`_planner`). Imports every layer below it,
nothing above.
"""
