"""A Flower app running fedppl's PVI (see ``app.py`` and ``task.py``)."""
