"""kvcanary: one installed package, the code the tests run.

The repository keeps ``monitor/``, ``probes/``, ``workers/``, ``migrations/``, ``alerts/`` and
``dashboards/`` at the top, and ``kvcanary/<folder>`` links to each, so every import names the
package users install (``kvcanary.monitor``, ``kvcanary.probes``, ...) in a checkout, an editable
install and the wheel alike, and no generic top-level name is claimed. The gateway tap
(``kvcanary.tap``) and the wire both sides share (``kvcanary.wire``) live here too.
"""
