"""Spike load for Locust: `-f loadtests/locustfile.py,loadtests/shape_spike.py --spike-users 16 --spike-start 20`."""
from loadtests.shapes import SpikeLoadShape


class SpikeShape(SpikeLoadShape):
    """--spike-base-users, then --spike-users for --spike-length seconds; stops after --shape-duration."""
