"""Shared test helpers (importable because pytest.ini puts tests/ on sys.path)."""
