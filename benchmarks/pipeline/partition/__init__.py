"""``python -m benchmarks.pipeline --partition planned``: the planned stage
split against DeepSpeed's partition methods under the same budgets.
:mod:`.runner` chooses the rows and launches through a launcher it is given
(the ranks run :func:`benchmarks.pipeline.rank.measure_layouts`), :mod:`.report`
presents them. It uses the pipeline's shared measurement, never
:mod:`benchmarks.pipeline.lengths` nor :mod:`benchmarks.pipeline.runner`. This
file imports nothing.
"""
