"""kvcanary's Grafana dashboards as code: built with grafana-foundation-sdk, committed as JSON.

``python -m dashboards.build`` writes the JSON files beside this file; ``--check`` fails when they
are stale. The monitor itself never imports this package: ``monitor.commands.dashboards`` pushes the
committed JSON (shipped in the wheel as ``kvcanary/dashboards``) and reads its queries.
"""
