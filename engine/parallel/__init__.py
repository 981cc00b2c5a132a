"""Parallel layout: expert parallelism over ZeRO-3 data parallelism, launching local ranks, planning layouts."""
