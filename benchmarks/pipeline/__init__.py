"""The pipeline benchmark: stages trained by DeepSpeed's pipeline engine, on
local ranks, per checkpointing mode (``python -m benchmarks.pipeline``,
:mod:`.runner`); with ``--budget`` the planner against uniform intervals
(:mod:`.budget`), with ``--partition planned`` the planned stage split
(:mod:`.partition`), with ``--lengths`` budgets under varying sequence lengths
(:mod:`.lengths`); and which segments to checkpoint beside upstream's reentrant
path (``python -m benchmarks.pipeline.segment_choice``, on its own).

The measurement all of them share (:mod:`.modes`, :mod:`.models`, :mod:`.rank`,
:mod:`.report`, :mod:`.budget`) imports neither :mod:`.partition` nor
:mod:`.lengths`, and those two never import each other nor :mod:`.runner`,
which alone parses the command line, launches ranks and prints. Nothing here
imports :mod:`benchmarks.checkpointing`: what both subjects record the same
way is in :mod:`benchmarks.common`. This file imports nothing, so that a rank,
started by ``run_ranks`` with a function of :mod:`.rank` or
:mod:`.lengths.rank`, and ``segment_choice`` load only what they use.
"""
