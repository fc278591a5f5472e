"""The run's record, at the bottom of the house: its typed models (``models``), the world state
and its integrity check, the sample folder's layout, durable writes, provenance, and the readers
the report and the cohort commands share (``collect``). Nothing here imports from above it."""
