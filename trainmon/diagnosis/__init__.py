"""Diagnosis: where a precision problem starts -- first step, first module, rank.

Modules (each usable on its own; none imports torch):

* ``reader``     -- a run directory's CSVs as one table in training-flow order
* ``flow``       -- the phases of a step and the order of the families in them
* ``rules``      -- the anomaly rules (nonfinite, spike, threshold), shared with the alert sink
* ``scan``       -- those rules over a whole run, plus the run's own ``anomalies.jsonl``
* ``compare``    -- two runs aligned row by row; the first divergence
* ``ranks``      -- what must agree across data-parallel ranks
* ``plot``       -- layers x steps heatmaps (matplotlib, imported only by this module)
* ``escalation`` -- "record more for K steps after the first alert"

The ``trainmon anomalies | compare | ranks | plot`` commands are thin layers over these;
docs/diagnosis.md documents their output fields.
"""
