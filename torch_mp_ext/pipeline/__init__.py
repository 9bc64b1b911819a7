"""Pipelines of generator stages across processes: :func:`pipeline` and ``@stage``.

- :mod:`.api`: :func:`pipeline`, :func:`stage`, :class:`Pipeline`, :class:`Stage`.
- :mod:`.links`: the queues between stages and what travels on them besides items.
- :mod:`.run`: the consumer's side: starting, watching and stopping the stage processes.
- :mod:`.stage_process`: what a stage's process runs.
"""

from .api import SHUTDOWN_GRACE_S, Pipeline, Stage, pipeline, stage

__all__ = ["SHUTDOWN_GRACE_S", "Pipeline", "Stage", "pipeline", "stage"]
