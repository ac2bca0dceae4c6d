"""Adapters that put dapo_kernels under other projects' APIs (:mod:`.verl`). Importing them
imports nothing of those projects; only ``verl.apply()`` touches a verl installation."""
