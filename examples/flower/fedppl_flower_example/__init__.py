"""A Flower app running fedppl's PVI: its task (``task.py``); the apps are fedppl's own."""
