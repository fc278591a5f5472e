"""Replay: re-run a recorded analysis with no model and compare it step by step.

The record is first checked whole and unaltered (agent/record/integrity.py). The recorded successful
calls are then re-issued in order with their exact parameters (ReplayPolicy) through the same
runner and loop as the original run, on the same input data (checked by content, wherever it now
lies: ``--input``), in a scratch folder. Each replayed step is then compared with its recorded
counterpart: the results (every field, recursively), the parameters, and the data digests before
and after. Verdicts:

- ``reproduced``: every result field and every digest identical;
- ``within tolerance``: some numbers differ, all within ``|a - b| <= atol + rtol * |b|``
  (b = recorded); digests that differ are then settled by comparing the two steps' checkpoints
  with the same tolerance, where both exist;
- ``diverged at step k``: the first recorded step k whose replay differs beyond that;
- ``altered at step k`` (``altered`` when only meta is): the record fails its integrity check,
  whatever the comparison found (the summary says both);
- ``not replayed``: the record cannot be read, or its input is missing or holds other data;
  or the machine failed the replay (full disk, I/O error, no memory): no finding about the
  record, ``machine_fault`` true, exit 4, which the workflow's replay job does not accept, so the
  next run replays it.

The run's input is compared by content, never by name: a record of version 2 names it
``<input>`` in load_data's result, and an older record's name for it is read as that.

The package: ``compare`` (what differs between a recorded step and its rerun, and the verdict),
``run`` (the checks before, the scratch folder, the rerun, the replay.json document) and ``cli``
(`python -m agent replay` and its exit statuses).
"""

from agent.replay.run import replay

__all__ = ["replay"]
