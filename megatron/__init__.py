"""Megatron-style model core on a DeepSpeed 3D engine.

Packages, in the one direction imports may run:
    training -> engine -> model -> parallel -> torch;  data is used by training.
Only ``megatron.engine`` imports deepspeed. ``megatron.model`` and ``megatron.parallel``
read no global arguments and no environment variables.
"""

__version__ = "0.1.0"
