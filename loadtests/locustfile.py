"""Locust entry point: `locust -f loadtests/locustfile.py --host http://127.0.0.1:8000 ChatUser`.

Add a load shape with a second file: `-f loadtests/locustfile.py,loadtests/shape_step.py` (or shape_spike.py).
"""
from loadtests.locust_users import ChatUser, CompletionsUser

__all__ = ["ChatUser", "CompletionsUser"]
