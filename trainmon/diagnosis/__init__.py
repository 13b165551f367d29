"""Diagnosis: where a precision problem starts -- first step, first module, rank.

Modules (none imports torch):

* ``engine`` / ``sql`` / ``engine_buckets`` -- a run's files read, ordered and staged by DuckDB,
  handed to the checks one bucket of tensor names at a time (``load_table``: a whole run)
* ``engine_compare`` / ``cluster`` -- ``compare`` group by group; buckets on a Dask cluster
* ``reader``     -- the run table the checks read; finding run directories
* ``scan``       -- the rules of ``trainmon.analysis.rules`` over a bucket, plus ``anomalies.jsonl``
* ``compare``    -- two runs aligned row by row; the first divergence
* ``ranks``      -- what must agree across data-parallel ranks
* ``plot``       -- layers x steps heatmaps (matplotlib, imported only by this module)

The ``trainmon anomalies | compare | ranks | plot`` commands are thin layers over these;
docs/diagnosis.md documents their output fields.
"""
