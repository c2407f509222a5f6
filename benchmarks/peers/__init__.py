"""Peer servers benchmarked beside tokenline (vLLM's CPU build), each set up in its own virtual environment."""
