"""Imported by the fork server of tests/helpers/dist.py (its last preload): work every rank would repeat, done once.

A rank that trains logs MFU, and on CPU MFU's peak is a matmul measurement (~0.6 s per process,
``titanlite.trainer.peaks.measure_cpu_matmul_peak``, cached per process). The fork server runs with one intra-op
thread, as the ranks do, so the figures it caches here are the ones a rank would have measured; forked ranks inherit
them. One thread makes no OpenMP team, so forking afterwards stays safe.
"""

import torch

from titanlite.trainer.peaks import measure_cpu_matmul_peak

for _dtype in ("float32", "bfloat16"):
    measure_cpu_matmul_peak(_dtype, threads=torch.get_num_threads())
