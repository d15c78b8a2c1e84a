"""Operations: a worker's health, probes, facts, metrics, devices and fleet."""
