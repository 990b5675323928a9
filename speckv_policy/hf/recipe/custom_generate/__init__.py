"""The ``custom_generate`` folder transformers loads ``generate.py`` from (see :mod:`speckv_policy.hf.recipe`)."""
