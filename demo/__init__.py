"""``kvcanary demo``: the leak reproduced and caught, as a newcomer runs it, in a package of its own
beside the product's commands (``monitor/commands/`` has the product's; ``cli.py`` calls
:func:`run_demo`, or ``pd.run_pd_demo`` for ``--topology pd``). It starts reference workers,
Prometheus, Alertmanager and a LiteLLM gateway as processes (``kvcanary/processes.py``) and runs the
real monitor in process: nothing here is a second copy of what the product does.
"""
