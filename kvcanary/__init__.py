"""kvcanary as a wheel installs it: the repository's top-level folders under one namespace.

In a checkout ``monitor/``, ``probes/``, ``workers/``, ``migrations/``, ``alerts/`` and
``dashboards/`` sit at the top and import each other by those names. The wheel installs them as
``kvcanary.monitor``, ``kvcanary.probes``, ... with their imports rewritten (``setup.py``), so it
claims no generic top-level name. This package itself holds only the console script's entry point.
"""
