"""The blast radius of an incident: which responses, of which callers, between when and when.

``question.py`` says what is asked (the window, the criterion, the scope); ``window.py`` and
``criterion.py`` answer it from the incident's own rows; each source is one class behind
``source.BlastSource`` that counts what matches (``recorded.py``: the traffic the monitor kept;
``logs.py``: a gateway's log files through DuckDB; ``spendlogs.py``: LiteLLM's
``LiteLLM_SpendLogs`` table); ``compute.py`` asks each source in its list; ``report.py`` puts the
counts together, with what was excluded and why, and ``chart.py`` draws them.
"""
