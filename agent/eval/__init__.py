"""`agent eval`: a served model's decisions and speed scored before a cohort runs on it.

- ``cases``: the samples the decision points come from, built from data that packages ship;
- ``points``: the decision points of a reference analysis of each case, each with the set of
  acceptable decisions derived from the data and its rule (``agent/eval/points.json`` keeps them
  under version control; ``python -m agent eval --regenerate-points`` writes it anew);
- ``ask``: the model asked at a point with the very prompt a run would send there;
- ``scoring``: a decision executed on the session as it was at its point and judged by the rule
  and the checks of agent/checks.py;
- ``speed``: the server's speed over the eval, from the report's metrics code;
- ``page``: eval.html; ``cli``: the command.
"""
