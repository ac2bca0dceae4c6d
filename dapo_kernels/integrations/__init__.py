"""Adapters that put dapo_kernels under other projects' APIs (:mod:`.verl`, :mod:`.transformers`).
Importing ``.verl`` imports nothing of verl; only ``verl.apply()`` touches a verl installation.
Importing ``.transformers`` registers the ``"dapo_varlen"`` attention implementation with transformers."""
