"""Staircase load for Locust: `-f loadtests/locustfile.py,loadtests/shape_step.py --step-users 2 --step-time 10`."""
from loadtests.shapes import StepLoadShape


class StepShape(StepLoadShape):
    """Adds --step-users every --step-time seconds up to --step-max-users; stops after --shape-duration."""
