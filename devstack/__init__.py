"""The development stack shared by tests/ and bench/: Postgres databases, Redis indexes, moto,
the API and workers as real processes, and generated inputs."""
