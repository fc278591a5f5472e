# Fixtures live beside the tests that own them; this list makes them visible everywhere.
pytest_plugins: list[str] = [
    "tests.fixtures_scripted",
    "tests.fixtures_workflow",
    "tests.fixtures_report",
    "tests.fixtures_vllm",
    "tests.fixtures_data",
    "tests.fixtures_realdata",
    "tests.fixtures_cohort",
    "tests.fixtures_slurm",
]
