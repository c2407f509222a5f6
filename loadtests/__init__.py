"""Black-box load tests for OpenAI-compatible servers: Locust users and the benchmark runner (`python -m loadtests.bench`)."""
