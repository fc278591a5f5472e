# Fixtures live beside the tests that own them; this list makes them visible everywhere.
pytest_plugins: list[str] = ["tests.fixtures_scripted"]
