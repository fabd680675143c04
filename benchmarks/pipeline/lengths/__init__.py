"""``python -m benchmarks.pipeline --lengths``: stage budgets under sequence
lengths that vary from step to step. :mod:`.runner` makes the schedule of
lengths and the configurations, :mod:`.rank` is one rank's side (started by
``run_ranks`` as :func:`.rank.measure_lengths`), :mod:`.report` presents the
records. It uses the pipeline's shared measurement, never
:mod:`benchmarks.pipeline.partition` nor :mod:`benchmarks.pipeline.runner`.
This file imports nothing.
"""
