"""Judging real traffic: the records a gateway tap (``kvcanary.tap``) posts to ``/api/v1/traffic``
or publishes to NATS JetStream.

``schema`` is the wire (what a record may hold, bounded); ``overlap`` the fingerprint window of
one deployment; ``checks`` the four checks (marker, tokens, capacity, overlap) as plain functions;
``judge`` maps each record to its target and node, runs the checks and turns what they find into
results for the one recording path (``monitor/recording/port.py``) and rows for ``storage``;
``ingest`` stores and records a batch. From JetStream: ``stream_setup`` (the stream, its consumers,
the ownership bucket), ``partitions`` (which replica consumes which partition), ``jetstream`` (pull,
judge once by record id, acknowledge).
"""
