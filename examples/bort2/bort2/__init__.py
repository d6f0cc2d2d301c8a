"""BORT2 (Robust Target Training for Multi-Source Domain Adaptation, BMVC 2022) on hypergrad.

Layout: ``config`` (schema, YAML + CLI overrides, validation), ``data/`` (benchmarks, views),
``models/`` (digit CNN, ResNets, MixStyle, stochastic layers), ``step1/`` (one-step MSDA methods
and their stage), ``step2/`` (naive, Stage B, Stage C and the hyper step), ``trainer`` (the one
training loop and the stage registry), ``checkpoint``, ``evaluation``, ``runner`` (units, in
parallel), ``report`` (tables, mechanism, figures), ``engine`` (the entry points). Installed with
``pip install -e examples/bort2``; run with ``python examples/bort2/run.py``.
"""
